"""Choosing one index per row of a [R, V] tensor: the argmax, or a draw by weight.

`argmax_rows` equals `x.argmax(-1)` (the first index of the maximum). On CPU, torch's
argmax does not vectorize and is far slower than `amax`, which does (docs/benchmarks.md,
'Figures that code comments used to quote'): the rows are cut into chunks, the chunk maxima
found with `amax`, and the argmax runs over the chunk maxima and then inside the one chunk
that holds the first maximum.

`draw_rows` samples index i with probability w_i / sum(w) by inverting the cumulative
weights at one uniform number per row, so a seeded row needs one number from its own
generator, whatever else is in the batch. Over a whole vocabulary the inversion is done in
two levels (chunk sums, then inside the chosen chunk) to avoid a float64 cumsum of [R, V];
small candidate sets are inverted in one level. Cumulative sums are float64, so a token's
probability is that of its float32 weight (no mass is lost to rounding in a long float32
cumsum). A zero weight is never drawn.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 256  # elements per chunk: ~the fastest for 49k-151k vocabularies on CPU


def argmax_rows(x: Tensor) -> Tensor:
    """x.argmax(-1) for x [R, V], fast on CPU. # -> [R] int64"""
    rows, vocab = x.shape
    if x.device.type != "cpu" or vocab < 4 * CHUNK or rows == 0:
        return x.argmax(dim=-1)
    main = vocab - vocab % CHUNK
    maxima = x[:, :main].view(rows, main // CHUNK, CHUNK).amax(dim=-1)  # [R, N]
    if main < vocab:
        tail = x[:, main:].amax(dim=-1, keepdim=True)  # [R, 1]
        maxima = torch.cat([maxima, tail], dim=1)
    first = maxima.argmax(dim=-1) * CHUNK  # [R] the chunk holding the first maximum
    # Positions past the end repeat the last element, after its real position: the
    # first maximum in the window is still the real one.
    window = (first.unsqueeze(1) + torch.arange(CHUNK, device=x.device)).clamp_(max=vocab - 1)
    return first + x.gather(1, window).argmax(dim=-1)


def draw_rows(weights: Tensor, u: Tensor) -> Tensor:
    """Per row, index i with probability weights[i] / sum; u [R] float64 in [0, 1).

    weights: [R, V] >= 0 with a positive entry per row. # -> [R] int64
    """
    rows, vocab = weights.shape
    if vocab <= 2 * CHUNK:
        return _invert(weights.double().cumsum(dim=-1), weights > 0, u)
    main = vocab - vocab % CHUNK
    sums = weights[:, :main].view(rows, main // CHUNK, CHUNK).sum(dim=-1)  # [R, N]
    if main < vocab:
        sums = torch.cat([sums, weights[:, main:].sum(dim=-1, keepdim=True)], dim=1)
    sums64 = sums.double()
    cum = sums64.cumsum(dim=-1)  # [R, N]
    chunk = _invert(cum, sums > 0, u)  # [R]
    # Where u fell inside the chosen chunk, as a uniform number of its own.
    before = torch.where(chunk > 0, cum.gather(1, (chunk - 1).clamp(min=0).unsqueeze(1))[:, 0], 0)
    mass = sums64.gather(1, chunk.unsqueeze(1))[:, 0]
    inner = ((u * cum[:, -1] - before) / mass).clamp_(0.0, 1.0)
    start = chunk * CHUNK
    pos = start.unsqueeze(1) + torch.arange(CHUNK, device=weights.device)  # [R, CHUNK]
    inside = pos < vocab
    w = weights.gather(1, pos.clamp(max=vocab - 1)) * inside  # [R, CHUNK]
    return start + _invert(w.double().cumsum(dim=-1), w > 0, inner)


def _invert(cum: Tensor, positive: Tensor, u: Tensor) -> Tensor:
    """The first index whose cumulative weight exceeds u * total (never a zero weight).

    cum: [R, K] float64 cumulative weights; positive: [R, K] weight > 0; u: [R] float64.
    """
    target = (u * cum[:, -1]).unsqueeze(1)  # [R, 1]
    index = (cum <= target).sum(dim=-1)  # [R]
    # u * total can round up to the total: fall back to the last positive weight.
    ranks = torch.arange(cum.shape[1], device=cum.device)
    last = torch.where(positive, ranks, -1).amax(dim=-1)
    return torch.minimum(index, last)
