"""One request inside an engine: its tokens, sampling settings and KV blocks.

Lifecycle of a Sequence (status transitions; nothing else is allowed):
  WAITING   -> RUNNING     the prefill scheduler admitted it (blocks allocated)
  RUNNING   -> WAITING     its prompt is computed and a first token sampled; it waits
                           for a place in the decode batch (or for migration)
  WAITING   -> RUNNING     the decode scheduler admitted it into its batch
  RUNNING   -> PREEMPTED   decode ran out of blocks (or, with nothing running, a
                           WAITING one held them); its blocks were freed and its
                           prompt + output will be prefilled again
  PREEMPTED -> RUNNING     the prefill scheduler re-admitted it for that recompute
  any       -> FINISHED    stop/eos token, max_tokens, session_len, or abort
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmd.engine.grammar import check_guided

if TYPE_CHECKING:
    from lmd.engine.grammar import Guide

MAX_LOGPROBS = 20
# Bounds on what a request may ask the sampler to carry per step.
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 256
MAX_WORD_TOKENS = 32
# The sampler divides float32 logits by the temperature and scales them by the repetition
# penalty: past these bounds a logit overflows to inf, the softmax turns to NaN and the
# step fails (taking every request of the worker with it).
GREEDY_BELOW = 1e-5  # a lower temperature samples greedily (as vLLM does)
MAX_TEMPERATURE = 1e4  # far past the point where every token is about equally likely
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """The OpenAI `finish_reason` values a sequence can end with."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class SamplingParams:
    """How to choose each next token, and when to stop.

    temperature 0 (or below GREEDY_BELOW) is greedy. top_k 0 and top_p 1 and min_p 0 are
    off. logprobs None returns none; N in 0..20 returns the chosen token's logprob and N
    alternatives.
    min_new_tokens keeps eos and stop_token_ids from ending the output earlier.
    presence_penalty and frequency_penalty (OpenAI's, -2..2) lower the logits of the output
    tokens so far; logit_bias adds (token id, bias in -100..100) pairs; bad_words (token id
    sequences) are never completed (penalties.py). guided (kind, spec) keeps the output
    inside a JSON schema, a regex or a grammar (grammar.py).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    guided: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        self._check_openai_penalties()
        self.guided = check_guided(self.guided)
        self.temperature = _number("temperature", self.temperature)
        self.top_p = _number("top_p", self.top_p)
        self.min_p = _number("min_p", self.min_p)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature > MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be <= {MAX_TEMPERATURE:g}, got {self.temperature:g}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {self.repetition_penalty:g}"
            )
        _integer("top_k", self.top_k, minimum=0)
        _integer("max_tokens", self.max_tokens, minimum=1)
        _integer("min_new_tokens", self.min_new_tokens, minimum=0)
        if self.seed is not None:
            _integer("seed", self.seed, minimum=None)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for token_id in self.stop_token_ids:
            _integer("stop_token_ids entry", token_id, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    def _check_openai_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value:g}")
            setattr(self, name, value)
        bias: list[tuple[int, float]] = []
        for pair in self.logit_bias:
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise ValueError(f"logit_bias entries must be (token id, bias), got {pair!r}")
            _integer("logit_bias token id", pair[0], minimum=0)
            value = _number("logit_bias value", pair[1])
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value:g}")
            bias.append((pair[0], value))
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        self.logit_bias = tuple(bias)
        words = tuple(tuple(word) for word in self.bad_words)
        if len(words) > MAX_BAD_WORDS or any(not 0 < len(w) <= MAX_WORD_TOKENS for w in words):
            raise ValueError(
                f"bad_words takes at most {MAX_BAD_WORDS} words of 1-{MAX_WORD_TOKENS} tokens"
            )
        for word in words:
            for token_id in word:
                _integer("bad_words token id", token_id, minimum=0)
        self.bad_words = words

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def counts_tokens(self) -> bool:
        """presence or frequency penalties: they count the output tokens so far."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """A penalty, a bias or a bad word changes its logits (penalties.py)."""
        return (
            self.repetition_penalty != 1.0
            or self.counts_tokens
            or bool(self.logit_bias or self.bad_words)
        )

    @property
    def needs_history(self) -> bool:
        """Its logits depend on every earlier token (a step cannot run ahead of one)."""
        if self.repetition_penalty != 1.0 or self.counts_tokens or self.guided is not None:
            return True
        return bool(self.bad_words) and any(len(w) > 1 for w in self.bad_words)


@dataclass(slots=True, eq=False)
class Sequence:
    """A request's tokens and KV bookkeeping; compared by identity.

    num_cached_tokens counts the leading tokens whose KV is already in `block_table`
    (prefix-cache hits plus prefill chunks and decode steps that ran). The block
    manager owns `block_table`; schedulers own `status`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_prefix_cached_tokens: int = 0  # of the prompt, served by the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    guide: Guide | None = None  # its place in sampling.guided's grammar (grammar.py)

    def __post_init__(self) -> None:
        ids = self.prompt_token_ids = list(self.prompt_token_ids)
        if not ids:
            raise ValueError(f"request {self.request_id}: the prompt has no tokens")
        if not (are_ints(ids) and min(ids) >= 0):  # else the first bad one, named
            for token_id in ids:
                _integer("prompt token id", token_id, minimum=0)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output: what a (re)prefill computes."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncached_tokens(self) -> int:
        return self.num_tokens - self.num_cached_tokens

    @property
    def last_token_id(self) -> int:
        if self.output_token_ids:
            return self.output_token_ids[-1]
        return self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(
        self, token_id: int, *, eos_token_ids: Collection[int], max_seq_len: int | None
    ) -> FinishReason | None:
        """Add a sampled token; finish the sequence if it stops here and say why.

        The stopping token itself is kept in the output (it counts as generated, as in
        vLLM); the detokenizer leaves special tokens out of the text.
        """
        if self.is_finished:
            raise RuntimeError(f"request {self.request_id} is finished; cannot append")
        # Plain len() calls, not the properties: this runs for every token.
        sampling, output = self.sampling, self.output_token_ids
        may_stop = len(output) >= sampling.min_new_tokens
        output.append(token_id)
        eos = not sampling.ignore_eos and token_id in eos_token_ids
        reason: FinishReason | None = None
        if (self.guide is not None and self._guide_ends(token_id)) or (
            may_stop and (eos or token_id in sampling.stop_token_ids)
        ):
            reason = FinishReason.STOP
        elif len(output) >= sampling.max_tokens or (
            max_seq_len is not None and len(self.prompt_token_ids) + len(output) >= max_seq_len
        ):
            reason = FinishReason.LENGTH
        if reason is not None:
            self.finish(reason)
        return reason

    def _guide_ends(self, token_id: int) -> bool:
        """Hand the token to the guide: the output ends when the grammar took its end
        token, or (never with the mask applied) when the grammar refuses the token."""
        assert self.guide is not None
        return not self.guide.accept(token_id) or self.guide.is_done

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason


def check_token_ids(seq: Sequence, vocab_size: int) -> None:
    """ValueError naming the first token id of `seq` (prompt, output or stop_token_ids)
    outside the model's vocabulary [0, vocab_size): such an id would index past the
    embedding or the logits and fail the whole step, every request of the worker with it.
    """
    for what, ids in (
        ("prompt token id", seq.prompt_token_ids),
        ("output token id", seq.output_token_ids),
        ("stop_token_ids entry", seq.sampling.stop_token_ids),
        ("logit_bias token id", [t for t, _ in seq.sampling.logit_bias]),
        ("bad_words token id", [t for w in seq.sampling.bad_words for t in w]),
    ):
        bad = first_outside(ids, vocab_size)
        if bad is not None:
            raise ValueError(
                f"request {seq.request_id}: {what} {bad} is outside this model's "
                f"vocabulary (0-{vocab_size - 1})"
            )


def banned_token_ids(seq: Sequence, eos_token_ids: SequenceOf[int], ahead: int = 0) -> list[int]:
    """Tokens the sampler must not pick yet, because min_new_tokens is not reached.

    `ahead`: output tokens sampled already but not appended yet (a step run ahead).
    """
    if seq.num_output_tokens + ahead >= seq.sampling.min_new_tokens or seq.guide is not None:
        return []  # a guided row: its grammar says when it may end
    banned = list(seq.sampling.stop_token_ids)
    if not seq.sampling.ignore_eos:
        banned.extend(eos_token_ids)
    return banned


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return float(value)


def first_outside(ids: SequenceOf[int], vocab_size: int) -> int | None:
    """The first of `ids` outside the vocabulary [0, vocab_size), or None. The common
    case, none, is decided by min and max in C (a prompt runs to thousands of ids)."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return None
    return next((t for t in ids if not 0 <= t < vocab_size), None)


def are_ints(values: Collection[object]) -> bool:
    """Ints, not bools. A prompt runs to thousands of ids: one pass over their types in C
    first (the per-token check in Python cost ~1% of a SmolLM2 batch on a GPU)."""
    if set(map(type, values)) == {int}:
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def _integer(name: str, value: object, *, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
