"""What an engine step gives back: one event per sampled token."""

from __future__ import annotations

from dataclasses import dataclass

from lmd.engine.sampler import TokenLogprobs
from lmd.engine.sequence import FinishReason


@dataclass(slots=True)
class TokenEvent:
    """One sampled token of one request (not frozen: one is built per token, and a
    frozen dataclass is several times slower to build; docs/benchmarks.md, 'Per-request
    and per-token CPU in the api and tokenizer')."""

    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None
    finish_reason: FinishReason | None  # set on the request's last token
    cached_tokens: int = 0  # prompt tokens the prefix cache served at its (last) prefill
    position: int = 0  # index among the request's output tokens (0: the first)
