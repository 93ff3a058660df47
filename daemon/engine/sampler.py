"""Choose each sequence's next token from a batch of logits, on the logits' device.

Order of processing, per row (as in transformers and vLLM):
  repetition_penalty (over prompt + output) -> ban eos/stop tokens while
  min_new_tokens is not reached -> greedy rows take the argmax; the others apply
  temperature -> top_k -> top_p -> min_p and draw one token.

Drawing uses the exponential race (argmax of probs / Exp(1) noise), which samples the
categorical distribution exactly. A row with a seed draws its noise from its own
generator seeded by (seed, number of tokens generated so far), so its tokens do not
depend on the rest of the batch, on preemption, or on which process samples them.
Logprobs are those of the model's raw distribution (before penalties and warpers).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import torch

from lmd.engine.sequence import Sequence, banned_token_ids

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

    def sample(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> SamplerOutput:
        """One next token per row of `logits` ([B, V]) for the matching `seqs[i]`."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(
                f"logits must be [B, V] with B = {len(seqs)} sequences, got {tuple(logits.shape)}"
            )
        raw = logits.float()  # [B, V]
        x = raw.clone()
        self._apply_repetition_penalty(x, seqs)
        self._apply_bans(x, seqs)
        greedy_tokens = x.argmax(dim=-1)  # [B]
        if all(seq.sampling.is_greedy for seq in seqs):
            tokens = greedy_tokens
        else:
            probs = self._warp(x, seqs).softmax(dim=-1)  # [B, V]
            noise = self._exponential_noise(probs, seqs)  # [B, V]
            sampled = (probs / noise).argmax(dim=-1)  # [B]
            greedy = torch.tensor([s.sampling.is_greedy for s in seqs], device=x.device)
            tokens = torch.where(greedy, greedy_tokens, sampled)
        return self._with_logprobs(raw, tokens, seqs)

    def _apply_repetition_penalty(self, x: torch.Tensor, seqs: SequenceOf[Sequence]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.sampling.repetition_penalty != 1.0]
        if not rows:
            return
        histories = [seqs[i].token_ids for i in rows]
        width = max(len(h) for h in histories)
        # Pad with a token already in the row: a repeated index rewrites the same value.
        padded = [h + [h[0]] * (width - len(h)) for h in histories]
        ids = torch.tensor(padded, dtype=torch.long, device=x.device)  # [R, T]
        penalty = torch.tensor(
            [seqs[i].sampling.repetition_penalty for i in rows], device=x.device
        ).unsqueeze(1)  # [R, 1]
        index = torch.tensor(rows, dtype=torch.long, device=x.device)
        sub = x.index_select(0, index)  # [R, V]
        score = sub.gather(1, ids)  # [R, T]
        score = torch.where(score > 0, score / penalty, score * penalty)
        sub.scatter_(1, ids, score)
        x.index_copy_(0, index, sub)

    def _apply_bans(self, x: torch.Tensor, seqs: SequenceOf[Sequence]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, seq in enumerate(seqs):
            banned = banned_token_ids(seq, self.eos_token_ids)
            rows.extend([i] * len(banned))
            cols.extend(banned)
        if rows:
            r = torch.tensor(rows, dtype=torch.long, device=x.device)
            c = torch.tensor(cols, dtype=torch.long, device=x.device)
            x[r, c] = float("-inf")

    def _warp(self, x: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        """Temperature, then top_k, top_p and min_p as -inf masks. # [B, V]"""
        params = [s.sampling for s in seqs]
        device = x.device
        vocab = x.shape[1]
        temperature = torch.tensor(
            [p.temperature if p.temperature > 0 else 1.0 for p in params], device=device
        )
        x = x / temperature.unsqueeze(1)
        use_top_k = any(p.top_k > 0 for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_k or use_top_p:
            ordered, order = x.sort(dim=-1, descending=True)  # [B, V] each
            if use_top_k:
                k = torch.tensor([p.top_k or vocab for p in params], device=device)
                rank = torch.arange(vocab, device=device).unsqueeze(0)  # [1, V]
                ordered = ordered.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
            if use_top_p:
                top_p = torch.tensor([p.top_p for p in params], device=device)
                p_sorted = ordered.softmax(dim=-1)
                # Keep the smallest prefix whose mass reaches top_p (the first always).
                before = p_sorted.cumsum(dim=-1) - p_sorted
                ordered = ordered.masked_fill(before > top_p.unsqueeze(1), float("-inf"))
            x = torch.empty_like(x).scatter_(1, order, ordered)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            probs = x.softmax(dim=-1)
            floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            x = x.masked_fill(probs < floor, float("-inf"))
        return x

    def _exponential_noise(self, probs: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_()  # [B, V]
        for i, seq in enumerate(seqs):
            seed = seq.sampling.seed
            if seed is None or seq.sampling.is_greedy:
                continue
            generator = torch.Generator(device=probs.device)
            generator.manual_seed(step_seed(seed, seq.num_output_tokens))
            noise[i].exponential_(generator=generator)
        return noise

    def _with_logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, seqs: SequenceOf[Sequence]
    ) -> SamplerOutput:
        asked = [s.sampling.logprobs for s in seqs]
        if all(n is None for n in asked):
            return SamplerOutput(tokens, num_logprobs=asked)
        logprobs = raw.log_softmax(dim=-1)  # [B, V]
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [B]
        most = min(max(n or 0 for n in asked), logprobs.shape[1])
        top_lps, top_ids = logprobs.topk(most, dim=-1)  # [B, N] each
        return SamplerOutput(tokens, chosen, top_ids, top_lps, asked)
