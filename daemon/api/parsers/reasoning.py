"""Reasoning in a reply: `<think>...</think>` (DeepSeek-R1, Qwen3) split from the answer.

A `ThinkStream` takes the reply's text in pieces and gives back (reasoning, content)
pieces; `parse` is the same machine fed the whole text, so a stream adds up to exactly
the non-streamed answer. Where the reply starts matters, and the prompt decides it
(`opened`):
  - the reply starts with `<think>`: reasoning up to `</think>`, then content;
  - `opened=True`, the prompt ended inside `<think>` (DeepSeek-R1's template, Qwen3's
    thinking templates): reasoning from the start up to `</think>`; a reply cut short
    before it is all reasoning;
  - `opened=False`, the prompt opened none (or closed it, as Qwen3's with
    enable_thinking false): the reply is content;
  - `opened=None`, not known: text before a `</think>` is reasoning, and with no
    `</think>` at all the reply is content. A stream holds the text back until it
    knows which, so only this case delays a stream.
Whitespace next to the tags belongs to neither side (`<think>\\n...\\n</think>\\n\\n`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lmd.api.parsers.tool_calls import marker_start

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


@dataclass(frozen=True, slots=True)
class ThinkSyntax:
    """A reasoning parser by name: how it reads a reply when the request says nothing."""

    name: str
    opened: bool | None  # does the prompt open <think>, when the request does not say


# DeepSeek-R1's template ends the prompt with <think>; Qwen3's varies by version.
DEEPSEEK_R1 = ThinkSyntax("deepseek_r1", opened=True)
QWEN3 = ThinkSyntax("qwen3", opened=None)


class _State(enum.IntEnum):
    START = 0  # whitespace, or the beginning of <think>, so far
    THINK = 1
    UNDECIDED = 2  # reasoning if a </think> comes, else content
    CONTENT = 3


class ThinkStream:
    """One reply's reasoning split from its content, as the text comes."""

    __slots__ = ("_lead", "_opened", "_pending", "_state", "_undecided", "_undecided_tail")

    def __init__(self, opened: bool | None) -> None:
        self._opened = opened
        self._state = _State.START
        self._pending = ""  # text held back
        self._lead = True  # whitespace at the start of the current side is dropped
        # UNDECIDED: the reply so far (a list: it may be the whole reply), and its last
        # characters, where a </think> split across pieces begins
        self._undecided: list[str] = []
        self._undecided_tail = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that this piece of text makes known."""
        if self._state is _State.UNDECIDED:
            probe = self._undecided_tail + text
            if CLOSE_TAG not in probe:
                self._undecided.append(text)
                self._undecided_tail = probe[-(len(CLOSE_TAG) - 1) :]
                return "", ""
            text = "".join(self._undecided) + text
            self._undecided.clear()
        buf, self._pending = self._pending + text, ""
        reasoning = ""
        while True:
            state = self._state
            if state is _State.START:
                rest = buf.lstrip()
                if not rest or (len(rest) < len(OPEN_TAG) and OPEN_TAG.startswith(rest)):
                    self._pending = buf
                    return reasoning, ""
                if rest.startswith(OPEN_TAG):
                    buf = rest[len(OPEN_TAG) :]
                    self._state = _State.THINK
                elif self._opened is None:
                    self._state = _State.UNDECIDED
                else:
                    self._state = _State.THINK if self._opened else _State.CONTENT
                    self._lead = self._opened
            elif state is _State.THINK or state is _State.UNDECIDED:
                at = buf.find(CLOSE_TAG)
                if at >= 0:
                    reasoning += self._lstrip(buf[:at]).rstrip()
                    buf = buf[at + len(CLOSE_TAG) :]
                    self._state, self._lead = _State.CONTENT, True
                    continue
                if state is _State.UNDECIDED:
                    self._undecided = [buf]
                    self._undecided_tail = buf[-(len(CLOSE_TAG) - 1) :]
                    return reasoning, ""
                cut = marker_start(buf, CLOSE_TAG)
                body = self._lstrip(buf[:cut])
                kept = body.rstrip()  # whitespace may come right before </think>
                self._pending = body[len(kept) :] + buf[cut:]
                return reasoning + kept, ""
            else:
                if self._lead:
                    buf = buf.lstrip()
                    if not buf:
                        return reasoning, ""
                    self._lead = False
                return reasoning, buf

    def _lstrip(self, text: str) -> str:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        return text

    def finish(self) -> tuple[str, str]:
        """The end of the reply: the text held back, on the side it was on."""
        pending, self._pending = self._pending, ""
        state = self._state
        if state is _State.START:
            return (pending, "") if self._opened else ("", pending)
        if state is _State.THINK:
            return self._lstrip(pending), ""
        if state is _State.UNDECIDED:  # no </think> came: content, as it was
            pending, self._undecided = "".join(self._undecided), []
        return "", pending

    def parse(self, text: str) -> tuple[str, str]:
        """A whole reply: (reasoning, content)."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content
