"""A group's batch-1 all-reduce done by the products (turbo/exchange.py): gemv's `send`
and vector_gemv's `received`, for a group of 2 and of 3 "ranks" that share one device
(their pointer tables name each other's buffers, as the mapped ones do on CUDA).

Against the same products with the sum made first (rank order, rounded once): equal,
bit for bit, over three steps whose tags wrap (a 16-bit value's tag is the step mod
2^16: the words of the step before never pass for this step's).
As tests/unit/test_turbo_kernels.py: Triton's interpreter on CPU tensors without CUDA,
compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_turbo_kernels import DEVICE, DTYPES

pytest.importorskip("triton")

from lmd.engine.turbo import kernels
from lmd.engine.turbo.exchange import WORDS, PeerExchange, Point

POINTS = 3


def group(size: int, width: int, dtype: torch.dtype) -> list[PeerExchange]:
    """`size` exchanges in one process, each rank's table naming every rank's words."""
    word = WORDS[torch.empty(0, dtype=dtype).element_size()]
    words = [torch.zeros(POINTS, size, width, dtype=word, device=DEVICE) for _ in range(size)]
    ptrs = torch.tensor([t.data_ptr() for t in words], dtype=torch.int64, device=DEVICE)
    rows = [torch.full((POINTS, width), float("nan"), device=DEVICE).to(dtype) for _ in words]
    return [PeerExchange(r, rows[r], words[r], ptrs) for r in range(size)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("size", "k_in", "width", "n_out", "activation"),
    [(2, 48, 40, 24, None), (3, 100, 70, 33, None), (2, 48, 40, 24, "silu")],
)
def test_products_all_reduce_through_the_exchange(
    size: int, k_in: int, width: int, n_out: int, *, activation: str | None, dtype: torch.dtype
) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    exchanges = group(size, width, dtype)
    w_in = [rand(width, k_in) / k_in**0.5 for _ in range(size)]  # each rank's o / down
    w_out, norm_w = rand(n_out, width) / width**0.5, 1 + 0.1 * rand(width)
    residual = rand(1, width)
    point = POINTS - 1  # every step uses every point, as a model's do: here one
    first = 2**16 - 2  # steps 2^16 - 1, 2^16 (tag 0), 2^16 + 1
    for ex in exchanges:
        ex.step.fill_(first - 1)
    for step in range(first, first + 3):
        for ex in exchanges:
            ex.begin_step()
        xs = [rand(1, k_in) for _ in range(size)]
        sent = [
            kernels.gemv(x, w, send=Point(ex, point))
            for x, w, ex in zip(xs, w_in, exchanges, strict=True)
        ]
        partials = [kernels.gemv(x, w) for x, w in zip(xs, w_in, strict=True)]
        for got, want in zip(sent, partials, strict=True):
            assert torch.equal(got, want)
        total = torch.zeros(1, width, device=DEVICE)
        for p in partials:
            total += p.float()
        reduced = total.to(dtype)  # what an all-reduce hands each rank
        want_sum = torch.empty_like(residual)
        want = kernels.vector_gemv(
            reduced,
            w_out,
            norm=kernels.Norm(norm_w, 1e-6, residual, want_sum),
            activation=activation,
        )
        bits = 8 * residual.element_size()
        for ex, row in zip(exchanges, sent, strict=True):
            tags = (ex.words[point].long() >> bits) & (2**bits - 1)  # the peers' rows
            peers = [q for q in range(size) if q != ex.rank]
            assert torch.equal(tags[peers], torch.full_like(tags[peers], step % 2**bits))
            summed = torch.empty_like(residual)
            got = kernels.vector_gemv(
                row,
                w_out,
                norm=kernels.Norm(norm_w, 1e-6, residual, summed),
                received=Point(ex, point),
                activation=activation,
            )
            assert torch.equal(got, want) and torch.equal(summed, want_sum)
        residual = want_sum


def test_the_exchange_refuses_what_it_cannot_carry() -> None:
    ex = group(2, 16, torch.float32)[0]
    with pytest.raises(ValueError, match="point 3 of an exchange of 3"):
        Point(ex, 3)
    w = torch.zeros(16, 8, device=DEVICE)
    with pytest.raises(ValueError, match="sends one row"):
        kernels.gemv(torch.zeros(2, 8, device=DEVICE), w, send=Point(ex, 0))
    with pytest.raises(ValueError, match="receives rows"):
        kernels.vector_gemv(torch.zeros(1, 8, device=DEVICE), w[:, :8], received=Point(ex, 0))
    with pytest.raises(ValueError, match="twice the rows' width"):
        PeerExchange(0, ex.rows, ex.words.int(), ex.word_ptrs)
    with pytest.raises(ValueError, match="whose row is x"):
        x, square = torch.zeros(1, 16, device=DEVICE), torch.zeros(16, 16, device=DEVICE)
        kernels.vector_gemv(x, square, received=Point(ex, 0))
