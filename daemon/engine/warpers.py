"""Temperature, top_k, top_p and min_p: the tokens each sampled row may draw, and how likely.

The result for each row is a candidate set: either token ids found with `topk` (most likely
first) with their weights, or the whole vocabulary in id order. Weights are probabilities up
to a per-row factor; 0 means dropped. A row with top_k or top_p is reduced to its survivors
before anything is drawn, so the work after the warp is per candidate, not per vocabulary
entry.

Semantics, in this order (as transformers and vLLM; the same as masking [B, V] with -inf):
  temperature  divides the logits;
  top_k        keeps the k most likely (exactly k: a tie at the cut is broken by `topk`);
  top_p        keeps the smallest most-likely-first prefix whose probability, renormalized
               after top_k, reaches top_p (the first token always);
  min_p        drops tokens less likely than min_p times the most likely survivor.
Each row's candidates depend only on its own logits and parameters, never on the other rows
of the batch: rows are grouped by top_k, and a top_p row without top_k widens its own
candidate set (TOP_P_STAGES, then the full sort) until the survivors fit in it.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch
from torch import Tensor

from lmd.engine.sequence import SamplingParams

# Candidate counts a top_p row (without top_k) tries before sorting its whole vocabulary
# (per row on one CPU core: topk 64 0.06 ms, 1024 0.4 ms, 8192 ~0.9 ms; the sort 3.2 ms).
TOP_P_STAGES = (64, 1024, 8192)


@dataclass(slots=True)
class Candidates:
    """What some rows of a batch may draw."""

    rows: list[int]  # positions of these rows in the batch
    token_ids: Tensor | None  # [R, K] int64; None: the whole vocabulary in id order
    weights: Tensor  # [R, K] (or [R, V]) float32 >= 0, a positive entry per row


def warp(x: Tensor, rows: list[int], params: SequenceOf[SamplingParams]) -> list[Candidates]:
    """Candidate sets for `rows` of the logits x [B, V]; params[i] belongs to row rows[i]."""
    vocab = x.shape[1]
    by_top_k: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        by_top_k.setdefault(p.top_k if 0 < p.top_k < vocab else 0, []).append(i)
    out: list[Candidates] = []
    for k, members in by_top_k.items():
        group = [params[i] for i in members]
        scaled = _scaled(x, [rows[i] for i in members], group)  # [R, V]
        if k:
            values, ids = scaled.topk(k, dim=-1)  # [R, k] each, most likely first
            probs = values.softmax(dim=-1)
            out.append(_top_p_min_p([rows[i] for i in members], ids, probs, group))
            continue
        nucleus = [j for j, p in enumerate(group) if p.top_p < 1.0]
        whole = [j for j, p in enumerate(group) if p.top_p >= 1.0]
        if whole:
            out.append(_whole([rows[members[j]] for j in whole], scaled[whole], group, whole))
        if nucleus:
            out += _nucleus([rows[members[j]] for j in nucleus], scaled[nucleus], group, nucleus)
    return out


def _scaled(x: Tensor, rows: list[int], params: list[SamplingParams]) -> Tensor:
    """The rows' logits divided by their temperatures. # [R, V]"""
    index = torch.tensor(rows, dtype=torch.long, device=x.device)
    temperature = torch.tensor([p.temperature for p in params], device=x.device)
    return x.index_select(0, index) / temperature.unsqueeze(1)


def _whole(
    rows: list[int], scaled: Tensor, group: list[SamplingParams], picked: list[int]
) -> Candidates:
    """Rows with neither top_k nor top_p: the whole vocabulary, min_p applied."""
    probs = scaled.softmax(dim=-1)  # [R, V]
    min_p = [group[j].min_p for j in picked]
    if any(m > 0 for m in min_p):
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=probs.device)[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    return Candidates(rows, None, probs)


def _nucleus(
    rows: list[int], scaled: Tensor, group: list[SamplingParams], picked: list[int]
) -> list[Candidates]:
    """Rows with top_p and no top_k: the most likely tokens until the survivors fit."""
    vocab = scaled.shape[1]
    params = [group[j] for j in picked]
    probs = scaled.softmax(dim=-1)  # [R, V], normalized over the whole vocabulary
    top_p = torch.tensor([p.top_p for p in params], device=scaled.device)
    out: list[Candidates] = []
    left = list(range(len(rows)))
    for size in (*(s for s in TOP_P_STAGES if s < vocab), vocab):
        index = torch.tensor(left, dtype=torch.long, device=scaled.device)
        if size < vocab:
            _, ids = scaled.index_select(0, index).topk(size, dim=-1)  # [R, size]
        else:
            _, ids = scaled.index_select(0, index).sort(dim=-1, descending=True)
        p = probs.index_select(0, index).gather(1, ids)  # [R, size], most likely first
        # The survivors fit when the mass of all `size` candidates passes top_p: the next
        # token would have more than top_p before it, so it is cut.
        mass = p.cumsum(dim=-1)[:, -1]  # summed in the order the top_p cut sums them
        fits = (mass > top_p.index_select(0, index)).tolist() if size < vocab else None
        done = [n for n in range(len(left)) if fits is None or fits[n]]
        if done:
            sel = torch.tensor(done, dtype=torch.long, device=scaled.device)
            out.append(
                _top_p_min_p(
                    [rows[left[n]] for n in done],
                    ids.index_select(0, sel),
                    p.index_select(0, sel),
                    [params[left[n]] for n in done],
                )
            )
        left = [left[n] for n in range(len(left)) if fits is not None and not fits[n]]
        if not left:
            break
    return out


def _top_p_min_p(
    rows: list[int], ids: Tensor, probs: Tensor, params: list[SamplingParams]
) -> Candidates:
    """top_p then min_p over candidates sorted most likely first. probs: [R, K]"""
    device = probs.device
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely candidates
        # Keep the smallest prefix reaching top_p (the first always); top_p = 1 keeps all.
        probs = probs.masked_fill((before > top_p) & (top_p < 1.0), 0.0)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < probs[:, :1] * min_p, 0.0)  # [:, 0] is the max
    return Candidates(rows, ids, probs)
