"""How one chat reply is read: its reasoning split off, then its tool calls parsed.

The reply's text goes through the reasoning parser (reasoning.py) when one is
configured, and what it leaves as content through the request's tool-call parser
(tool_calls.py, named_call.py) when the request gave tools. `ReplyParser.stream()`
reads a streamed reply piece by piece; `ReplyParser.parse` reads a whole one with the
same machines, so the stream's pieces add up to the non-streamed message exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmd.api.parsers.named_call import NamedCallStream
from lmd.api.parsers.reasoning import ThinkStream, ThinkSyntax
from lmd.api.parsers.tool_calls import CallStream, Syntax, ToolStream, assemble


@dataclass(slots=True)
class ReplyDelta:
    """What one piece of a reply adds, by the field of a stream's `delta` it goes in."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The stream chunk's `delta`: only the fields this piece has something for."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out

    def extend(self, other: ReplyDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


@dataclass(frozen=True, slots=True)
class ReplyParser:
    """The parsers of one request's reply: `think` and `opened` (reasoning.py) when a
    reasoning parser is configured; `tools` (a format's Syntax) or `function` (a named
    tool_choice) when the request's tools are in play."""

    think: ThinkSyntax | None = None
    opened: bool | None = None  # does the prompt open <think> (None: not known)
    tools: Syntax | None = None
    function: str | None = None

    def stream(self) -> ReplyStream:
        return ReplyStream(self)

    def parse(self, text: str) -> dict[str, Any]:
        """A whole reply as the fields of OpenAI's message: `content` (None when the
        reply is only calls), `tool_calls` when there are any, `reasoning_content`
        (None when there was none) when a reasoning parser is configured."""
        stream = self.stream()
        whole = stream.feed(text)
        whole.extend(stream.finish())
        content = whole.content
        calls = assemble(whole.tool_calls)
        out: dict[str, Any] = {"content": None if calls and not content else content}
        if calls:
            out["tool_calls"] = calls
        if self.think is not None:
            out["reasoning_content"] = whole.reasoning or None
        return out


class ReplyStream:
    """One reply read piece by piece: reasoning first, then tool calls in the content."""

    __slots__ = ("_calls", "_think")

    def __init__(self, parser: ReplyParser) -> None:
        self._think = None if parser.think is None else ThinkStream(parser.opened)
        self._calls: CallStream | None = None
        if parser.function is not None:
            self._calls = NamedCallStream(parser.function)
        elif parser.tools is not None:
            self._calls = ToolStream(parser.tools)

    @property
    def num_calls(self) -> int:
        return 0 if self._calls is None else self._calls.num_calls

    def feed(self, text: str) -> ReplyDelta:
        reasoning, content = ("", text) if self._think is None else self._think.feed(text)
        return self._with_calls(reasoning, content, last=False)

    def finish(self) -> ReplyDelta:
        """The end of the reply: whatever the parsers held back."""
        reasoning, content = ("", "") if self._think is None else self._think.finish()
        return self._with_calls(reasoning, content, last=True)

    def _with_calls(self, reasoning: str, content: str, last: bool) -> ReplyDelta:
        calls = self._calls
        if calls is None:
            return ReplyDelta(reasoning, content)
        out = calls.feed(content) if content else None
        if last:
            end = calls.finish()
            if out is None:
                out = end
            else:
                out.content += end.content
                out.tool_calls += end.tool_calls
        if out is None:
            return ReplyDelta(reasoning)
        return ReplyDelta(reasoning, out.content, out.tool_calls)


def finish_reason(reason: str, num_calls: int) -> str:
    """OpenAI's: a reply that stopped by itself after calling tools ends in tool_calls."""
    return "tool_calls" if reason == "stop" and num_calls else reason
