"""categorical: the fast argmax and the inverse-CDF draw against plain torch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lmd.engine.categorical import CHUNK, argmax_rows, draw_rows


@pytest.mark.parametrize("vocab", [5, 4 * CHUNK, 4 * CHUNK + 77, 49152])
def test_argmax_rows_is_the_first_maximum_like_torch(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1] = 0.0  # all tied: the first index
    x[2] = float("-inf")
    x[3, -1] = 100.0  # the maximum in the tail past the last whole chunk
    x[4, 3] = x[4, vocab - 2] = 100.0  # a tie: the first one wins
    x[5, : vocab // 2] = x[5, vocab // 2 :].amax()  # ties spread over many chunks
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


def test_draw_rows_follows_the_weights_across_chunks() -> None:
    vocab = 5 * CHUNK + 100  # several chunks and a short tail
    weights = torch.zeros(1, vocab)
    expected = {3: 0.4, CHUNK + 5: 0.3, 3 * CHUNK: 0.2, vocab - 1: 0.1}
    for token, p in expected.items():
        weights[0, token] = p * 7.0  # weights need not sum to 1
    n = 4000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    counts = Counter(draw_rows(weights.expand(n, vocab), u).tolist())
    assert set(counts) == set(expected)  # a zero weight is never drawn
    for token, p in expected.items():
        assert abs(counts[token] / n - p) < 0.03


def test_draw_rows_never_draws_a_zero_weight_at_the_ends_of_u() -> None:
    for vocab in (7, 3 * CHUNK + 1):
        weights = torch.zeros(3, vocab)
        weights[:, 1] = 1e-30
        weights[:, vocab - 2] = 1.0  # the last token has weight 0
        u = torch.tensor([0.0, 0.5, 1.0 - 2**-53], dtype=torch.float64)
        assert draw_rows(weights, u).tolist() == [1, vocab - 2, vocab - 2]
