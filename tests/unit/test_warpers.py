"""warpers: candidate sets equal the full-vocabulary -inf masking they replace."""

from __future__ import annotations

import itertools

import pytest
import torch

from lmd.engine.sequence import SamplingParams
from lmd.engine.warpers import TOP_P_STAGES, Candidates, warp


def reference(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's probabilities by masking the whole vocabulary (the sampler before). # [V]"""
    row = x / p.temperature
    vocab = row.shape[0]
    ordered, order = row.sort(descending=True)
    if p.top_k:
        ordered = ordered.masked_fill(torch.arange(vocab) >= p.top_k, float("-inf"))
    if p.top_p < 1.0:
        p_sorted = ordered.softmax(dim=-1)
        ordered = ordered.masked_fill(p_sorted.cumsum(-1) - p_sorted > p.top_p, float("-inf"))
    row = torch.empty_like(row).scatter_(0, order, ordered)
    if p.min_p > 0:
        probs = row.softmax(dim=-1)
        row = row.masked_fill(probs < probs.max() * p.min_p, float("-inf"))
    return row.softmax(dim=-1)


def dense(groups: list[Candidates], batch: int, vocab: int) -> torch.Tensor:
    """The candidate sets as normalized [B, V] probabilities (rows not sampled stay 0)."""
    out = torch.zeros(batch, vocab)
    for group in groups:
        w = group.weights / group.weights.sum(dim=-1, keepdim=True)
        for n, row in enumerate(group.rows):
            if group.token_ids is None:
                out[row] = w[n]
            else:
                out[row].index_add_(0, group.token_ids[n], w[n])
    return out


PARAMS = [
    SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp)
    for t, k, tp, mp in itertools.product(
        (0.5, 1.0, 1.7), (0, 1, 5, 300), (1.0, 0.3, 0.9, 0.999), (0.0, 0.05)
    )
]


@pytest.mark.parametrize("vocab", [50, 2000])
def test_candidates_equal_the_masked_full_vocabulary(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(len(PARAMS), vocab, generator=g) * 3
    rows = list(range(len(PARAMS)))
    got = dense(warp(x, rows, PARAMS), len(PARAMS), vocab)
    for i, p in enumerate(PARAMS):
        torch.testing.assert_close(got[i], reference(x[i], p), atol=1e-6, rtol=1e-4, msg=str(p))


def test_top_p_widens_its_candidates_until_the_survivors_fit() -> None:
    vocab = 3000
    # Nearly flat: top_p 0.1 needs ~300 tokens (second stage), 0.6 ~1800 (the full sort).
    x = -torch.arange(vocab, dtype=torch.float32).unsqueeze(0).repeat(3, 1) * 1e-4
    params = [SamplingParams(top_p=tp) for tp in (0.01, 0.1, 0.6)]
    groups = warp(x, [0, 1, 2], params)
    kept = dense(groups, 3, vocab).gt(0).sum(dim=-1).tolist()
    assert kept[0] <= TOP_P_STAGES[0] < kept[1] <= TOP_P_STAGES[1] < kept[2]
    for i, p in enumerate(params):
        assert kept[i] == int(reference(x[i], p).gt(0).sum())


def test_rows_get_the_same_candidates_alone_and_in_any_batch() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(len(PARAMS), 500, generator=g)
    together = dense(warp(x, list(range(len(PARAMS))), PARAMS), len(PARAMS), 500)
    for i, p in enumerate(PARAMS):
        alone = dense(warp(x[i : i + 1], [0], [p]), 1, 500)[0]
        assert torch.equal(alone, together[i])
