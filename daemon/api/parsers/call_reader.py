"""One tool call's JSON object, `{"name": ..., "arguments": {...}}`, read as it is written.

Life cycle of a call (what the sink sees):
  1. The object's characters arrive one at a time; its keys and the name's value are
     read whole, other values validated and skipped.
  2. The call is *committed* once its name is known and its arguments value has begun
     (`parameters` is taken for `arguments`, as Llama 3 writes it): the sink gets
     `start_call(name)`, then the arguments' characters as they come, verbatim, so a
     streamed call's pieces add up to exactly the text the model wrote. Arguments that
     come before the name wait for it. Arguments given as a JSON string are the
     string's text, sent once it closes.
  3. At the closing `}` an object with a name and no arguments is a call with `{}`
     (unless `needs_arguments`: Llama 3's bare JSON could be any JSON the model
     answered with); anything else without a committed call is not a call.
A character that cannot continue the object is an error (`Step.ERROR`): before the
commit the caller takes the object's text back as content; after it, the call stands
with the arguments written so far (as OpenAI's are when max_tokens cuts a call short).
"""

from __future__ import annotations

import enum
import json
from typing import Protocol

from lmd.api.parsers.json_scan import Step, ValueScanner, is_whitespace

ARGUMENT_KEYS = ("arguments", "parameters")


class CallSink(Protocol):
    def start_call(self, name: str) -> None: ...

    def add_arguments(self, text: str) -> None: ...


class _State(enum.IntEnum):
    OPEN = 0  # the `{`
    FIRST_KEY = 1  # a key or `}`
    KEY = 2  # a key (after a comma)
    IN_KEY = 3
    COLON = 4
    VALUE = 5  # whitespace, then a value
    IN_VALUE = 6
    AFTER = 7  # `,` or `}`
    DONE = 8


class _Value(enum.IntEnum):
    SKIP = 0  # a key we do not read
    NAME = 1
    STREAM = 2  # arguments as an object or array: sent verbatim as they come
    WHOLE = 3  # arguments as a string or a scalar: sent when complete


class CallReader:
    __slots__ = (
        "_args",
        "_key",
        "_kind",
        "_raw",
        "_scanner",
        "_sink",
        "_state",
        "arguments_done",
        "committed",
        "name",
        "needs_arguments",
    )

    def __init__(self, sink: CallSink, needs_arguments: bool = False) -> None:
        self._sink = sink
        self.needs_arguments = needs_arguments
        self._state = _State.OPEN
        self._scanner = ValueScanner()
        self._raw: list[str] = []  # the key or the value being read whole
        self._key = ""
        self._kind = _Value.SKIP
        self._args: list[str] | None = None  # arguments read before the name, waiting
        self.name: str | None = None
        self.committed = False
        self.arguments_done = False

    def feed(self, ch: str) -> Step:
        state = self._state
        if state is _State.IN_VALUE:
            return self._value_char(ch)
        if state is _State.IN_KEY:
            self._raw.append(ch)
            step = self._scanner.feed(ch)
            if step is Step.DONE:
                self._key = json.loads("".join(self._raw))
                self._state = _State.COLON
                return Step.MORE
            return step
        if state is _State.OPEN:
            if ch != "{":
                return Step.ERROR
            self._state = _State.FIRST_KEY
            return Step.MORE
        if is_whitespace(ch):
            return Step.MORE
        if state is _State.FIRST_KEY or state is _State.KEY:
            if ch == "}" and state is _State.FIRST_KEY:
                return self._close()
            if ch != '"':
                return Step.ERROR
            self._scanner, self._raw = ValueScanner(), [ch]
            self._scanner.feed(ch)
            self._state = _State.IN_KEY
            return Step.MORE
        if state is _State.COLON:
            if ch != ":":
                return Step.ERROR
            self._state = _State.VALUE
            return Step.MORE
        if state is _State.VALUE:
            self._begin_value(ch)
            self._state = _State.IN_VALUE
            return self._value_char(ch)
        if state is _State.AFTER:
            if ch == ",":
                self._state = _State.KEY
                return Step.MORE
            if ch == "}":
                return self._close()
        return Step.ERROR

    def feed_plain(self, text: str, at: int) -> int:
        """Take the run of `text` from `at` that only continues a string (a key, the name,
        the arguments' text) as `feed` would take it a character at a time; returns
        where the run ends (`at`: none here)."""
        state = self._state
        if state is not _State.IN_KEY and state is not _State.IN_VALUE:
            return at
        end = self._scanner.plain_run(text, at)
        if end > at:
            if state is _State.IN_VALUE and self._kind is _Value.STREAM and self.committed:
                self._sink.add_arguments(text[at:end])
            elif state is _State.IN_KEY or self._kind is not _Value.SKIP:
                self._raw.append(text[at:end])
        return end

    def _begin_value(self, ch: str) -> None:
        self._scanner, self._raw = ValueScanner(), []
        key = self._key
        if key == "name" and self.name is None:
            self._kind = _Value.NAME
        elif key in ARGUMENT_KEYS and not self.committed and self._args is None:
            self._kind = _Value.STREAM if ch in "{[" else _Value.WHOLE
            if self._kind is _Value.STREAM and self.name:
                self._commit(self.name, [])
            else:
                self._args = []
        else:
            self._kind = _Value.SKIP

    def _value_char(self, ch: str) -> Step:
        step = self._scanner.feed(ch)
        if step is Step.ERROR:
            return step
        if step is not Step.BEFORE:
            kind = self._kind
            if kind is _Value.STREAM and self.committed:
                self._sink.add_arguments(ch)
            elif kind is not _Value.SKIP:
                self._raw.append(ch)
        if step is Step.MORE:
            return step
        self._end_value()
        self._state = _State.AFTER
        return self.feed(ch) if step is Step.BEFORE else Step.MORE

    def _end_value(self) -> None:
        kind, raw = self._kind, "".join(self._raw)
        if kind is _Value.NAME:
            name = json.loads(raw)
            self.name = name if isinstance(name, str) and name else ""
            if self.name and self._args is not None:
                self._commit(self.name, self._args)
            return
        if kind is _Value.SKIP:
            return
        self.arguments_done = True
        if kind is _Value.WHOLE:
            value = json.loads(raw)
            text = value if isinstance(value, str) else raw
            if self.name:
                self._commit(self.name, [text])
            else:
                self._args = [text]
        elif not self.committed:
            self._args = [raw]  # a whole object, before the name

    def _commit(self, name: str, waiting: list[str]) -> None:
        self.committed = True
        self._args = None
        self._sink.start_call(name)
        if waiting:
            self._sink.add_arguments("".join(waiting))

    def _close(self) -> Step:
        self._state = _State.DONE
        if not self.committed and self.name and not self.needs_arguments:
            self.arguments_done = True
            self._commit(self.name, ["{}"])
        return Step.DONE
