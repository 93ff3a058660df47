"""Tool calls in a model's reply: the formats models write them in, read as a stream.

A `ToolStream` takes the reply's text in pieces (`feed`) and gives back what OpenAI's
stream deltas carry: `content` text and `tool_calls` entries. The first entry of a call
holds its `index`, `id`, `type` and `function.name` (and the first arguments, if any);
the later ones its `index` and the next piece of `function.arguments`. `parse` is the
same machine fed the whole text at once, so a stream's pieces add up to exactly the
non-streamed answer, however the text was split.

Life cycle of a reply in the stream:
  1. Text: content, except a tail that may be the start of the format's marker (held
     until it is known not to be one) and the whitespace before it.
  2. The marker (or, where the format allows, JSON at the very start of the reply)
     opens a call section: `Syntax` says what surrounds the calls (an array, `;`, a
     closing tag). Each call is a CallReader (call_reader.py).
  3. Text the section does not take is content again. Whitespace next to a call is not
     content. A call that could not be read before its commit is given back as
     content, marker included (invalid JSON is never an error).
  4. `finish`: held text is content, unless it is only what follows a call.
"""

from __future__ import annotations

import enum
import random
import string
from dataclasses import dataclass, field
from typing import Any, Protocol

from lmd.api.parsers.call_reader import CallReader
from lmd.api.parsers.json_scan import Step, is_whitespace

_ID_CHARS = string.ascii_letters + string.digits


def call_id() -> str:
    """A tool call id shaped as OpenAI's: call_ and 24 letters or digits."""
    return "call_" + "".join(random.choices(_ID_CHARS, k=24))


@dataclass(frozen=True, slots=True)
class Syntax:
    """What surrounds the calls of a format."""

    name: str
    start: str | None  # the marker that opens a call section anywhere in the text
    bare: bool = False  # a section may also open at the reply's start, with no marker
    open: str | None = None  # the section's first character: "[" for an array
    separator: str | None = None  # between two calls
    close: str | None = None  # the section's last character: "]"
    end: str | None = None  # the closing tag after a call, optional: "</tool_call>"
    needs_arguments: bool = False  # an object with a name alone is not a call


HERMES = Syntax("hermes", "<tool_call>", end="</tool_call>")
# Llama 3.x: the reply is the call (or several, `;` between), `<|python_tag|>` before it
# when the tokenizer keeps special tokens.
LLAMA3_JSON = Syntax(
    "llama3_json", "<|python_tag|>", bare=True, separator=";", needs_arguments=True
)
# Mistral: [TOOL_CALLS] then an array; a tokenizer that drops the special token leaves
# the array at the start of the reply.
MISTRAL = Syntax("mistral", "[TOOL_CALLS]", bare=True, open="[", separator=",", close="]")
# tool_choice "required" under constrained decoding: [{"name", "parameters"}, ...].
REQUIRED = Syntax("required", None, bare=True, open="[", separator=",", close="]")


@dataclass(slots=True)
class ToolsDelta:
    """What one piece of a reply adds: content text and tool_calls stream entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class CallStream(Protocol):
    """A reply's tool calls read as it comes (ToolStream, NamedCallStream)."""

    @property
    def num_calls(self) -> int: ...

    def feed(self, text: str) -> ToolsDelta: ...

    def finish(self) -> ToolsDelta: ...


def parse_calls(stream: CallStream, text: str) -> tuple[str, list[dict[str, Any]]]:
    """A whole reply through a fresh stream: its content and its calls (OpenAI's
    message.tool_calls), exactly what the stream's pieces add up to."""
    whole = stream.feed(text)
    last = stream.finish()
    return whole.content + last.content, assemble(whole.tool_calls + last.tool_calls)


class _Section(enum.IntEnum):
    OPEN = 0  # whitespace, then the syntax's opening character
    CALL = 1  # whitespace, then a call's `{` (or, in an empty array, `]`)
    IN_CALL = 2
    AFTER = 3  # whitespace, then a separator, the close or the end tag
    END = 4  # the end tag, matched so far


class ToolStream:
    """One reply's tool calls, read as the text comes (see the module's life cycle)."""

    def __init__(self, syntax: Syntax) -> None:
        self.syntax = syntax
        self.num_calls = 0
        self._in_section = False
        self._at_start = syntax.bare  # nothing but whitespace seen yet
        self._pending = ""  # text held back: a marker's start, whitespace
        self._after_call = False  # a section with calls just ended
        self._held: list[str] = []  # the section's text not yet a call
        self._state = _Section.OPEN
        self._reader: CallReader | None = None
        self._calls_in_section = 0
        self._end_matched = 0  # characters of syntax.end seen
        self._content: list[str] = []
        # stream entries not yet sent, each without its arguments' text: their pieces
        self._entries: list[tuple[dict[str, Any], list[str]]] = []

    # CallSink: what a CallReader reports -----------------------------------------------

    def start_call(self, name: str) -> None:
        self._held.clear()  # the marker and the JSON before the arguments: not content
        entry = {"index": self.num_calls, "id": call_id(), "type": "function"}
        self._entries.append(({**entry, "function": {"name": name}}, []))
        self.num_calls += 1
        self._calls_in_section += 1

    def add_arguments(self, text: str) -> None:
        if self._entries:  # the call's latest entry, not yet sent
            self._entries[-1][1].append(text)
        else:
            self._entries.append(({"index": self.num_calls - 1, "function": {}}, [text]))

    # Text in, deltas out ----------------------------------------------------------------

    def feed(self, text: str) -> ToolsDelta:
        while text:
            text = self._section(text) if self._in_section else self._text(text)
        return self._drain()

    def finish(self) -> ToolsDelta:
        """The end of the reply: what was held is content, unless it only trails a call."""
        if self._in_section:
            reader = self._reader
            uncommitted = reader is not None and not reader.committed
            self._close_section(give_back=uncommitted or self._calls_in_section == 0)
        elif self._pending:
            self._content.append(self._pending)
        self._pending = ""
        return self._drain()

    def _drain(self) -> ToolsDelta:
        out = ToolsDelta("".join(self._content))
        self._content.clear()
        for entry, pieces in self._entries:
            entry["function"]["arguments"] = "".join(pieces)
            out.tool_calls.append(entry)
        self._entries.clear()
        return out

    def _text(self, text: str) -> str:
        """Content up to a call section; returns the text after the section opened."""
        buf, self._pending = self._pending + text, ""
        if self._after_call:  # whitespace after a call is not content
            buf = buf.lstrip()
            if not buf:
                return ""
            self._after_call = False
        marker = self.syntax.start
        if self._at_start:
            rest = buf.lstrip()
            if not rest or (marker and len(rest) < len(marker) and marker.startswith(rest)):
                self._pending = buf  # nothing yet, or maybe the marker
                return ""
            self._at_start = False
            is_marker = marker is not None and rest.startswith(marker)
            if not is_marker and rest[0] == (self.syntax.open or "{"):
                self._open_section(buf[: len(buf) - len(rest)])
                return rest
        at = buf.find(marker) if marker else -1
        if marker and at >= 0:
            before = buf[:at]
            kept = before.rstrip()  # whitespace before a call is not content
            if kept:
                self._content.append(kept)
            self._open_section(before[len(kept) :] + marker)
            return buf[at + len(marker) :]
        cut = marker_start(buf, marker) if marker else len(buf)
        kept = buf[:cut].rstrip()  # whitespace is held: it may come before a call
        if kept:
            self._content.append(kept)
        self._pending = buf[len(kept) :]
        return ""

    def _open_section(self, held: str) -> None:
        self._in_section = True
        self._held = [held] if held else []
        self._state = _Section.OPEN
        self._reader = None
        self._calls_in_section = 0

    def _close_section(self, give_back: bool) -> None:
        """Leave the section; its held text is content when no call took it."""
        if give_back:
            self._content += self._held
        self._held.clear()
        self._in_section = False
        self._reader = None
        self._after_call = self._calls_in_section > 0 and not give_back

    def _section(self, text: str) -> str:
        """Feed the section character by character (a call's string a run at a time);
        returns the text after it ended."""
        i = 0
        while i < len(text):
            reader = self._reader
            if reader is not None and self._state is _Section.IN_CALL:
                end = reader.feed_plain(text, i)
                if end > i:
                    if not reader.committed:
                        self._held.append(text[i:end])
                    i = end
                    continue
            consumed = self._section_char(text[i])  # refused: the section has ended
            if not self._in_section:
                return text[i + 1 :] if consumed else text[i:]
            i += 1
        return ""

    def _section_char(self, ch: str) -> bool:
        """Take one character of a section; False: it ended the section unconsumed."""
        state, syntax = self._state, self.syntax
        if state is _Section.IN_CALL:
            return self._call_char(ch)
        if state is _Section.END:
            return self._end_char(ch)
        if is_whitespace(ch):
            self._held.append(ch)
            return True
        if state is _Section.OPEN and syntax.open is not None:
            if ch != syntax.open:
                self._close_section(give_back=True)
                return False
            self._held.append(ch)
            self._state = _Section.CALL
            return True
        if state is _Section.OPEN or state is _Section.CALL:
            if ch == "{":
                self._reader = CallReader(self, syntax.needs_arguments)
                self._state = _Section.IN_CALL
                return self._call_char(ch)
            if ch == syntax.close and state is _Section.CALL and self._calls_in_section == 0:
                self._close_section(give_back=False)  # an empty array: no call, no content
                return True
            self._close_section(give_back=True)
            return False
        # AFTER a call
        if ch == syntax.separator:
            self._held.append(ch)
            self._state = _Section.CALL
            return True
        if ch == syntax.close:
            self._held.append(ch)
            if syntax.end is None:
                self._close_section(give_back=False)
            else:
                self._state = _Section.END
            return True
        if syntax.end is not None:
            self._state = _Section.END
            return self._end_char(ch)
        self._close_section(give_back=False)
        return False

    def _call_char(self, ch: str) -> bool:
        reader = self._reader
        assert reader is not None
        step = reader.feed(ch)
        if step is Step.MORE:
            if not reader.committed:
                self._held.append(ch)
            return True
        if step is Step.DONE:
            if not reader.committed:  # valid JSON, but not a call: content
                self._held.append(ch)
                self._close_section(give_back=True)
                return True
            self._state = _Section.AFTER
            return True
        # An error: before the commit the section is given back as content.
        if not reader.committed:
            self._close_section(give_back=True)
            return False
        if reader.arguments_done:  # e.g. the call's `}` missing before </tool_call>
            self._state = _Section.AFTER
            return self._section_char(ch)
        self._close_section(give_back=False)
        return False

    def _end_char(self, ch: str) -> bool:
        end = self.syntax.end
        assert end is not None
        if self._end_matched == 0 and is_whitespace(ch):
            self._held.append(ch)
            return True
        if ch == end[self._end_matched]:
            self._end_matched += 1
            self._held.append(ch)
            if self._end_matched == len(end):
                self._end_matched = 0
                self._close_section(give_back=False)
            return True
        # Not the end tag: what was matched of it, and what follows, is text.
        matched, self._end_matched = end[: self._end_matched], 0
        self._close_section(give_back=False)
        self._pending = matched
        return False


def marker_start(text: str, marker: str) -> int:
    """Where the longest tail of `text` that could be the start of `marker` begins (len:
    none). `text` holds no whole marker, so only its last len(marker) - 1 characters
    are looked at, and only where the marker's first character is."""
    at = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while at >= 0 and not marker.startswith(text[at:]):
        at = text.find(marker[0], at + 1)
    return len(text) if at < 0 else at


def assemble(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stream entries merged into whole calls: OpenAI's message.tool_calls."""
    calls: dict[int, dict[str, Any]] = {}
    for entry in entries:
        call = calls.get(entry["index"])
        if call is None:
            function = entry["function"]
            call = calls[entry["index"]] = {
                "id": entry["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        else:
            call["function"]["arguments"] += entry["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]
