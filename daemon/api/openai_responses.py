"""OpenAI response bodies and stream chunks, built from the tokenizer's deltas.

Plain dicts (orjson encodes them), shaped as the OpenAI schema's
CreateChatCompletionResponse / CreateChatCompletionStreamResponse and
CreateCompletionResponse. One `ChatFormat` or `CompletionFormat` per request holds what
every chunk of it shares (id, created, model); its deltas are read as deltas.py says. A
request with n > 1 has n choices, `index` 0..n-1, each with its own deltas,
finish_reason and logprobs; a stream chunk carries one choice; usage counts the prompt
once and the completion tokens of every choice. `finish_reason` is stop, length, or
abort (LMDeploy's, when the server cut the request short), and tool_calls when a reply
that stopped by itself called tools. A chat reply with tools or a reasoning parser in
play is read by the request's `ReplyParser` (parsers/), one ReplyStream per choice: its
message gets `tool_calls` and `reasoning_content`, and its stream's deltas carry them as
they are read.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import orjson

from lmd.api.deltas import Answer, Delta, Tally
from lmd.api.openai_schema import ApiError
from lmd.api.parsers.reply import ReplyParser, ReplyStream, finish_reason

VERY_UNLIKELY_LOGPROB = -9999.0  # OpenAI's stand-in for a logprob too small to show
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` are the prompt's prefix-cache hits."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(answers: list[Answer]) -> dict[str, Any]:
    """A body's usage: the prompt once (as choice 0 computed it), every choice's output."""
    first, completion = answers[0], sum(a.completion_tokens for a in answers)
    return usage(first.prompt_tokens, completion, first.cached_tokens)


def _logprob(value: float) -> float:
    # JSON has no -inf; OpenAI documents -9999.0 for "very unlikely".
    return value if math.isfinite(value) else VERY_UNLIKELY_LOGPROB


@dataclass(slots=True)
class _Format(ABC):
    """The envelope every body and chunk of one response shares; ChatFormat and
    CompletionFormat say what a choice holds."""

    id: str
    created: int
    model: str
    include_usage: bool = False  # streams: `usage: null` on chunks, a usage chunk at the end
    n: int = 1  # choices
    CHUNK_OBJECT: ClassVar[str] = ""  # the `object` of this format's stream chunks
    # A stream chunk's SSE bytes around its one choice, rendered once per request.
    _sse_open: bytes = field(init=False, repr=False, default=b"")
    _sse_close: bytes = field(init=False, repr=False, default=b"")

    def __post_init__(self) -> None:
        # orjson writes keys in insertion order with no spaces, so these bytes around
        # orjson.dumps(choice) are exactly sse(self._chunk(CHUNK_OBJECT, [choice])).
        head = orjson.dumps(self._head(self.CHUNK_OBJECT))
        self._sse_open = b"data: " + head[:-1] + b',"choices":['
        self._sse_close = b'],"usage":null}\n\n' if self.include_usage else b"]}\n\n"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {**self._head(obj), "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    @abstractmethod
    def choice(self, delta: Delta) -> dict[str, Any] | None:
        """A delta's one choice of a stream chunk; None when it carries nothing to show."""

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        """The chunk for a delta; None when it carries nothing to show."""
        choice = self.choice(delta)
        return None if choice is None else self._chunk(self.CHUNK_OBJECT, [choice])

    def sse_chunk(self, delta: Delta) -> bytes | None:
        """sse(self.chunk(delta)), without building and encoding the envelope each time."""
        choice = self.choice(delta)
        if choice is None:
            return None
        return self._sse_open + orjson.dumps(choice) + self._sse_close

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """The last chunk of a stream with stream_options.include_usage: no choices."""
        return {
            **self._head(self.CHUNK_OBJECT),
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        }


@dataclass(slots=True)
class ChatFormat(_Format):
    CHUNK_OBJECT: ClassVar[str] = "chat.completion.chunk"

    reply: ReplyParser | None = None  # None: the reply's text is its content, as it is
    # each choice's reply as read so far (with a ReplyParser)
    _reading: dict[int, ReplyStream] = field(init=False, repr=False, default_factory=dict)

    def first_chunks(self) -> list[dict[str, Any]]:
        """A stream's first chunks: each choice's role."""
        delta = {"role": "assistant", "content": ""}
        return [
            self._chunk(
                self.CHUNK_OBJECT,
                [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
            )
            for i in range(self.n)
        ]

    def choice(self, delta: Delta) -> dict[str, Any] | None:
        reason = delta.finish_reason
        if self.reply is None:
            message = {"content": delta.text} if delta.text else {}
        else:
            message, reason = self._read(self.reply, delta)
        if not message and reason is None and not delta.logprobs:
            return None
        return {
            "index": delta.index,
            "delta": message,
            "logprobs": self.logprobs(delta.logprobs),
            "finish_reason": reason,
        }

    def _read(self, reply: ReplyParser, delta: Delta) -> tuple[dict[str, Any], str | None]:
        """A delta's `delta` and finish_reason, its text read by the reply's parsers: what
        they make known of content, reasoning and tool calls (text they hold back shows
        later)."""
        reading = self._reading.get(delta.index)
        if reading is None:
            reading = self._reading[delta.index] = reply.stream()
        piece = reading.feed(delta.text)
        reason = delta.finish_reason
        if reason is not None:
            piece.extend(reading.finish())
            reason = finish_reason(reason, reading.num_calls)
        return piece.message(), reason

    def response(self, answers: list[Answer]) -> dict[str, Any]:
        """The body of a whole answer: one Answer per choice, by index."""
        return {
            **self._head("chat.completion"),
            "choices": [self._whole_choice(i, answer) for i, answer in enumerate(answers)],
            "usage": usage_of(answers),
        }

    def _whole_choice(self, index: int, answer: Answer) -> dict[str, Any]:
        text = "".join(answer.text)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        reason = answer.finish_reason
        if self.reply is not None:
            message.update(self.reply.parse(text))
            if reason is not None:
                reason = finish_reason(reason, len(message.get("tool_calls", ())))
        return {
            "index": index,
            "message": message,
            "logprobs": self.logprobs(answer.logprobs),
            "finish_reason": reason,
        }

    @staticmethod
    def logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        content = [
            {
                "token": e["token"],
                "logprob": _logprob(e["logprob"]),
                "bytes": e["bytes"],
                "top_logprobs": [
                    {"token": t, "logprob": _logprob(lp), "bytes": raw} for t, lp, raw in e["top"]
                ],
            }
            for e in entries
        ]
        return {"content": content, "refusal": None}


@dataclass(slots=True)
class CompletionFormat(_Format):
    CHUNK_OBJECT: ClassVar[str] = "text_completion"

    # characters of output before each choice's next token (logprobs' text_offset)
    _offsets: dict[int, int] = field(init=False, repr=False, default_factory=dict)

    def choice(self, delta: Delta) -> dict[str, Any] | None:
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return None
        return {
            "index": delta.index,
            "text": delta.text,
            "logprobs": self.logprobs(delta.logprobs, delta.index),
            "finish_reason": delta.finish_reason,
        }

    def response(self, answers: list[Answer]) -> dict[str, Any]:
        """The body of a whole answer: one Answer per choice, by index."""
        choices = [
            {
                "index": i,
                "text": "".join(answer.text),
                "logprobs": self.logprobs(answer.logprobs, i),
                "finish_reason": answer.finish_reason,
            }
            for i, answer in enumerate(answers)
        ]
        return {**self._head("text_completion"), "choices": choices, "usage": usage_of(answers)}

    def logprobs(
        self, entries: list[dict[str, Any]] | None, index: int = 0
    ) -> dict[str, Any] | None:
        if entries is None:
            return None
        offsets = []
        offset = self._offsets.get(index, 0)
        for e in entries:
            offsets.append(offset)
            offset += len(e["token"])
        self._offsets[index] = offset
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [_logprob(e["logprob"]) for e in entries],
            "top_logprobs": [{t: _logprob(lp) for t, lp, _ in e["top"]} for e in entries],
            "text_offset": offsets,
        }


class Framing(Protocol):
    """How a stream's events become bytes (SSE here, JSON lines for interactive)."""

    @property
    def media_type(self) -> str: ...

    def head(self) -> list[bytes]:
        """What goes out before the first delta."""
        ...

    def frame(self, delta: Delta) -> bytes | None:
        """A delta's bytes; None when it carries nothing to show."""
        ...

    def error(self, err: ApiError) -> bytes:
        """An error after the 200 went out; the stream ends after it."""
        ...

    def tail(self, tally: Tally, ok: bool) -> list[bytes]:
        """What closes the stream (`tally`: its deltas'); `ok`: it ended without an error."""
        ...


@dataclass(slots=True)
class SseFraming:
    """A chat or completion stream as server-sent events, ending with [DONE]."""

    fmt: ChatFormat | CompletionFormat
    media_type: str = "text/event-stream"

    def head(self) -> list[bytes]:
        return [sse(c) for c in self.fmt.first_chunks()] if isinstance(self.fmt, ChatFormat) else []

    def frame(self, delta: Delta) -> bytes | None:
        return self.fmt.sse_chunk(delta)

    def error(self, err: ApiError) -> bytes:
        return sse(err.body)

    def tail(self, tally: Tally, ok: bool) -> list[bytes]:
        """The usage chunk (when asked for and the stream ended well), then [DONE]."""
        if not (self.fmt.include_usage and ok):
            return [SSE_DONE]
        usage_chunk = self.fmt.usage_chunk(
            tally.prompt_tokens, tally.completion_tokens, tally.cached_tokens
        )
        return [sse(usage_chunk), SSE_DONE]
