"""A request's answer as the api reads it from the tokenizer: each TextDelta entry is a
`Delta` of one of its choices (OpenAI's `n`; index 0 when it asked for one); `Answer`
adds one choice's deltas up (a non-streamed body), `Tally` counts where all of its
choices stand (the end of a stream, usage, metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmd import protocol


@dataclass(slots=True)
class Delta:
    """One choice's share of a TextDelta message (not frozen: one is made per streamed
    token, and a frozen dataclass is several times slower to construct; docs/benchmarks.md,
    'Per-request and per-token CPU in the api and tokenizer')."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None
    cached_tokens: int = 0  # of the prompt, served by the engine's prefix cache
    history_tokens: int = 0  # of the prompt, from an interactive session's earlier turns
    index: int = 0  # the choice it is of

    @classmethod
    def split(cls, msg: protocol.TextDelta) -> list[tuple[str, Delta]]:
        return [
            (rid, cls(text, reason, prompt, completion, lps, cached, history, index))
            for rid, text, reason, prompt, completion, lps, cached, history, index in zip(
                msg.request_ids,
                msg.texts,
                msg.finish_reasons,
                msg.prompt_tokens,
                msg.completion_tokens,
                msg.logprobs,
                msg.cached_tokens,
                msg.history_tokens,
                msg.indexes,
                strict=True,
            )
        ]


@dataclass(slots=True)
class Answer:
    """What the deltas of one choice add up to (for a non-streaming response)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    history_tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs  # in place: a copy per token is quadratic
        self.finish_reason = delta.finish_reason
        self.prompt_tokens = delta.prompt_tokens
        self.completion_tokens = delta.completion_tokens
        self.cached_tokens = delta.cached_tokens
        self.history_tokens = delta.history_tokens


@dataclass(slots=True)
class Tally:
    """Where the n choices of a request stand, from their deltas: tokens and finishes."""

    n: int = 1
    prompt_tokens: int = 0  # every choice's prompt: the one prompt
    completion: list[int] = field(default_factory=list)  # tokens so far, by choice
    cached: list[int] = field(default_factory=list)  # prompt tokens the prefix cache served
    finished: list[bool] = field(default_factory=list)
    num_finished: int = 0

    def __post_init__(self) -> None:
        self.completion, self.cached, self.finished = [0] * self.n, [0] * self.n, [False] * self.n

    def add(self, delta: Delta) -> bool:
        """Count a delta in; True when it finished the request's last choice."""
        i = delta.index
        self.prompt_tokens = delta.prompt_tokens
        self.completion[i], self.cached[i] = delta.completion_tokens, delta.cached_tokens
        if delta.finish_reason is not None and not self.finished[i]:
            self.finished[i] = True
            self.num_finished += 1
            return self.done
        return False

    @property
    def done(self) -> bool:
        return self.num_finished == self.n

    @property
    def completion_tokens(self) -> int:
        return sum(self.completion)

    @property
    def cached_tokens(self) -> int:
        """The prompt's cached tokens, as computed once: choice 0's (the later choices
        find it cached by choice 0)."""
        return self.cached[0]
