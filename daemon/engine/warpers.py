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
The [R, V] intermediates live in a Workspace (no fresh pages each step on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch
from torch import Tensor

from lmd.engine.sequence import SamplingParams
from lmd.engine.workspace import Workspace

# Candidate counts a top_p row (without top_k) tries before sorting its whole vocabulary:
# a topk of each size costs a fraction of that sort on a CPU core (docs/benchmarks.md,
# 'Figures that code comments used to quote').
TOP_P_STAGES = (64, 1024, 8192)


@dataclass(slots=True)
class Candidates:
    """What some rows of a batch may draw."""

    rows: list[int]  # positions of these rows in the batch
    token_ids: Tensor | None  # [R, K] int64; None: the whole vocabulary in id order
    weights: Tensor  # [R, K] (or [R, V]) float32 >= 0, a positive entry per row


def warp(
    x: Tensor,
    rows: list[int],
    params: SequenceOf[SamplingParams],
    workspace: Workspace | None = None,
) -> list[Candidates]:
    """Candidate sets for `rows` of the logits x [B, V]; params[i] belongs to row rows[i].

    The whole-vocabulary weights are views of `workspace` ("probs"): draw them before the
    workspace is used again.
    """
    ws = workspace or Workspace()
    vocab = x.shape[1]
    groups: dict[int, list[int]] = {}  # top_k -> members; 0: top_p only; -1: neither
    for i, p in enumerate(params):
        k = p.top_k if 0 < p.top_k < vocab else 0
        groups.setdefault(-1 if k == 0 and p.top_p >= 1.0 else k, []).append(i)
    out: list[Candidates] = []
    for k in sorted(groups, reverse=True):  # the whole-vocabulary rows last: see above
        group = [params[i] for i in groups[k]]
        group_rows = [rows[i] for i in groups[k]]
        if k > 0:
            values, ids = _scaled(x, group_rows, group, ws).topk(k, dim=-1)  # [R, k] each
            out.append(_top_p_min_p(group_rows, ids, values.softmax(dim=-1), group))
        elif k == 0:
            out += _nucleus(x, group_rows, group, ws)
        else:
            out.append(_whole(x, group_rows, group, ws))
    return out


def _scaled(x: Tensor, rows: list[int], params: list[SamplingParams], ws: Workspace) -> Tensor:
    """The rows' logits divided by their temperatures, in workspace "scaled". # [R, V]"""
    out = ws.get("scaled", len(rows), x.shape[1], x.device)
    if rows == list(range(x.shape[0])):
        out.copy_(x)
    else:
        torch.index_select(x, 0, torch.tensor(rows, dtype=torch.long, device=x.device), out=out)
    temperature = [p.temperature for p in params]
    if any(t != 1.0 for t in temperature):
        out.div_(torch.tensor(temperature, device=x.device).unsqueeze(1))
    return out


def _probs(x: Tensor, rows: list[int], params: list[SamplingParams], ws: Workspace) -> Tensor:
    """softmax of the rows' scaled logits, in workspace "probs". # [R, V]"""
    out = ws.get("probs", len(rows), x.shape[1], x.device)
    if rows == list(range(x.shape[0])) and all(p.temperature == 1.0 for p in params):
        return torch.softmax(x, dim=-1, out=out)
    return torch.softmax(_scaled(x, rows, params, ws), dim=-1, out=out)


def _whole(x: Tensor, rows: list[int], params: list[SamplingParams], ws: Workspace) -> Candidates:
    """Rows with neither top_k nor top_p: the whole vocabulary, min_p applied."""
    probs = _probs(x, rows, params, ws)  # [R, V]
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=x.device)[:, None]
        below = ws.get("mask", len(rows), x.shape[1], x.device, torch.bool)
        probs.masked_fill_(torch.lt(probs, floor, out=below), 0.0)
    return Candidates(rows, None, probs)


def _nucleus(
    x: Tensor, rows: list[int], params: list[SamplingParams], ws: Workspace
) -> list[Candidates]:
    """Rows with top_p and no top_k: the most likely tokens until the survivors fit."""
    vocab = x.shape[1]
    scaled = _scaled(x, rows, params, ws)  # [R, V]
    probs = ws.get("probs", len(rows), vocab, x.device)
    torch.softmax(scaled, dim=-1, out=probs)  # normalized over the whole vocabulary
    top_p = torch.tensor([p.top_p for p in params], device=x.device)
    out: list[Candidates] = []
    left = list(range(len(rows)))
    for size in (*(s for s in TOP_P_STAGES if s < vocab), vocab):
        index = torch.tensor(left, dtype=torch.long, device=x.device)
        if len(left) == len(rows):
            candidates = scaled
        else:
            candidates = ws.get("stage", len(left), vocab, x.device)
            torch.index_select(scaled, 0, index, out=candidates)
        if size < vocab:
            _, ids = candidates.topk(size, dim=-1)  # [R, size], most likely first
        else:
            _, ids = candidates.sort(dim=-1, descending=True)
        p = probs[index.unsqueeze(1), ids]  # [R, size]
        # The survivors fit when the mass of all `size` candidates passes top_p: the next
        # token would have more than top_p before it, so it is cut.
        mass = p.cumsum(dim=-1)[:, -1]  # summed in the order the top_p cut sums them
        fits = (mass > top_p.index_select(0, index)).tolist() if size < vocab else None
        done = [n for n in range(len(left)) if fits is None or fits[n]]
        if done:
            sel = torch.tensor(done, dtype=torch.long, device=x.device)
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
