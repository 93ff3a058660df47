"""Choose each sequence's next token from a batch of logits, on the logits' device.

Order of processing, per row (as in transformers and vLLM):
  repetition_penalty (over prompt + output) -> presence/frequency penalties -> logit_bias
  -> ban eos/stop tokens while min_new_tokens is not reached, and bad words
  (`penalties.py`) -> a guided row's grammar mask (`grammar.py`) -> greedy rows take
  the argmax; the others apply
  temperature -> top_k -> top_p -> min_p (`warpers.py`) and draw one token.

Only what a row needs is computed: the logits are copied only when some row has a penalty
or a ban, greedy rows only take an argmax, a sampled row with top_k or top_p draws from its
survivors alone, and logprobs are computed for the rows that asked for them.

Drawing inverts the cumulative probabilities at one uniform number per row
(`categorical.py`), which samples the categorical distribution exactly. A row with a seed
takes its number from its own generator seeded by (seed, number of tokens generated so
far), so its tokens do not depend on the rest of the batch, on preemption, or on which
process samples them. Logprobs are those of the model's raw distribution (before penalties
and warpers).

A step run ahead (engine.py: sampled before the previous step's tokens are read back) passes
`ahead=1`: every count of tokens generated so far is one more than the sequences show, and
repetition penalties, which need the missing token itself, are refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import torch

from lmd.engine.categorical import argmax_rows, draw_rows
from lmd.engine.grammar import GuideMasks
from lmd.engine.penalties import penalize
from lmd.engine.sequence import Sequence
from lmd.engine.warpers import warp
from lmd.engine.workspace import Workspace

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class TokenLogprobs:
    """The chosen token's logprob and the top alternatives (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, of the chosen tokens
    top_token_ids: torch.Tensor | None = None  # [B, N], N = most asked in the batch
    top_logprobs: torch.Tensor | None = None  # [B, N]
    num_logprobs: list[int | None] = field(default_factory=list)  # asked per row

    def to_host(self) -> SamplerOutput:
        """Copies in pinned host memory, queued behind the step on its stream (no wait);
        read them once an event recorded after this call has fired."""

        def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        tokens = pinned(self.token_ids)
        assert tokens is not None
        return SamplerOutput(
            tokens,
            pinned(self.logprobs),
            pinned(self.top_token_ids),
            pinned(self.top_logprobs),
            self.num_logprobs,
        )

    def tolist(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Token ids and per-row logprobs as Python values (one device sync)."""
        tokens: list[int] = self.token_ids.tolist()
        if self.logprobs is None:
            return tokens, [None] * len(tokens)
        chosen: list[float] = self.logprobs.tolist()
        top_ids: list[list[int]] = [] if self.top_token_ids is None else self.top_token_ids.tolist()
        top_lps: list[list[float]] = [] if self.top_logprobs is None else self.top_logprobs.tolist()
        rows: list[TokenLogprobs | None] = []
        for i, asked in enumerate(self.num_logprobs):
            if asked is None:
                rows.append(None)
                continue
            top = list(zip(top_ids[i][:asked], top_lps[i][:asked], strict=True)) if asked else []
            rows.append(TokenLogprobs(tokens[i], chosen[i], top))
        return tokens, rows


def step_seed(seed: int, step: int) -> int:
    """A 64-bit seed for one step of a seeded request (splitmix64 of seed and step)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """Batched sampling for one engine; `eos_token_ids` come from the model."""

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.workspace = Workspace()  # [B, V] scratch reused across steps (see workspace.py)
        self.masks = GuideMasks()  # grammar bitmasks (grammar.py), made on first use

    def sample(
        self, logits: torch.Tensor, seqs: SequenceOf[Sequence], ahead: int = 0
    ) -> SamplerOutput:
        """One next token per row of `logits` ([B, V]) for the matching `seqs[i]`.

        `ahead`: tokens each sequence has sampled that it does not hold yet (0 or 1).
        """
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(
                f"logits must be [B, V] with B = {len(seqs)} sequences, got {tuple(logits.shape)}"
            )
        raw = logits.float()  # [B, V]; the same tensor when already float32
        x = penalize(raw, seqs, self.eos_token_ids, self.workspace, ahead)
        # A finished row (a step run ahead of its end) has nothing left to follow.
        guided = [i for i, s in enumerate(seqs) if s.guide is not None and not s.is_finished]
        if guided:
            if x is raw:  # logprobs are the raw distribution's: mask a copy
                x = self.workspace.get("penalized", raw.shape[0], raw.shape[1], raw.device)
                x.copy_(raw)
            self.masks.apply(x, guided, [seqs[i].guide for i in guided])  # type: ignore[misc]
        # Every row's argmax (cheap next to sampling); sampled rows are overwritten below.
        tokens = argmax_rows(x)  # [B]
        sampled = [i for i, seq in enumerate(seqs) if not seq.sampling.is_greedy]
        if not sampled:
            return self._with_logprobs(raw, tokens, seqs)
        for group in warp(x, sampled, [seqs[i].sampling for i in sampled], self.workspace):
            u = uniforms([seqs[i] for i in group.rows], ahead).to(x.device)
            index = torch.tensor(group.rows, dtype=torch.long, device=x.device)
            choice = draw_rows(group.weights, u)  # [R] positions in the candidates
            if group.token_ids is not None:
                choice = group.token_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
            tokens[index] = choice
        return self._with_logprobs(raw, tokens, seqs)

    def _with_logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, seqs: SequenceOf[Sequence]
    ) -> SamplerOutput:
        asked = [s.sampling.logprobs for s in seqs]
        rows = [i for i, n in enumerate(asked) if n is not None]
        if not rows:
            return SamplerOutput(tokens, num_logprobs=asked)
        most = min(max(n or 0 for n in asked), raw.shape[1])
        logprobs = self.workspace.get("logprobs", len(rows), raw.shape[1], raw.device)
        if len(rows) == len(seqs):
            torch.log_softmax(raw, dim=-1, out=logprobs)  # [B, V]
            chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [B]
            top_lps, top_ids = logprobs.topk(most, dim=-1)  # [B, N] each
            return SamplerOutput(tokens, chosen, top_ids, top_lps, asked)
        # Only the rows that asked: [R, V] instead of [B, V]; the others stay 0.
        index = torch.tensor(rows, dtype=torch.long, device=raw.device)
        asking = self.workspace.get("scaled", len(rows), raw.shape[1], raw.device)
        torch.log_softmax(torch.index_select(raw, 0, index, out=asking), dim=-1, out=logprobs)
        picked = tokens.index_select(0, index).unsqueeze(1)
        chosen = torch.zeros(len(seqs), device=raw.device)
        chosen[index] = logprobs.gather(1, picked).squeeze(1)
        top_lps = torch.zeros(len(seqs), most, device=raw.device)
        top_ids = torch.zeros(len(seqs), most, dtype=torch.long, device=raw.device)
        top_lps[index], top_ids[index] = logprobs.topk(most, dim=-1)
        return SamplerOutput(tokens, chosen, top_ids, top_lps, asked)


def uniforms(seqs: SequenceOf[Sequence], ahead: int = 0) -> torch.Tensor:
    """One uniform number in [0, 1) per sequence, on the CPU. # [R] float64

    A seeded sequence's number comes from a generator seeded by (seed, tokens so far, with
    `ahead` sampled but not appended yet), so it is the same on any device and in any batch.
    """
    u = torch.rand(len(seqs), dtype=torch.float64)
    for n, seq in enumerate(seqs):
        if seq.sampling.seed is not None:
            generator = torch.Generator().manual_seed(
                step_seed(seq.sampling.seed, seq.num_output_tokens + ahead)
            )
            u[n] = torch.rand(1, dtype=torch.float64, generator=generator)
    return u
