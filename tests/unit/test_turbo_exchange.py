"""A group's batch-1 all-reduce done by the product (turbo/exchange.py): gemv's `send`,
for a group of 2 and of 3 "ranks" that share one device (their pointer tables name each
other's buffers, as the mapped ones do on CUDA).

Each rank's send waits for the other ranks' words. The interpreter runs one kernel at a
time, so a rank whose peers have not run yet finds their words already there: written
here as their kernels write them (their partial rows, tagged), and overwritten with the
same words when those kernels run. Against the partial rows summed first (rank order,
rounded once, what an all-reduce hands each rank): equal, bit for bit, on every rank,
over three steps whose tags wrap (a 16-bit value's tag is the step mod 2^16: the words
of the step before never pass for this step's).
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


def tagged(row: torch.Tensor, step: int, word: torch.dtype) -> torch.Tensor:
    """A row's words as kernels/tagged.py's `tag` makes them: the value's bits low, the
    step mod 2^bits high."""
    bits = 8 * row.element_size()
    value = row.view(torch.int16 if bits == 16 else torch.int32).long() & (2**bits - 1)
    w: torch.Tensor = ((step % 2**bits) << bits) | value  # int64: a 32-bit word's sign next
    if bits == 16:
        w = torch.where(w >= 2**31, w - 2**32, w)
    return w.to(word)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("size", "k_in", "width"), [(2, 48, 40), (3, 100, 70)])
def test_a_row_all_reduces_through_the_exchange(
    size: int, k_in: int, width: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    exchanges = group(size, width, dtype)
    w_in = [rand(width, k_in) / k_in**0.5 for _ in range(size)]  # each rank's o / down
    point = POINTS - 1  # every step uses every point, as a model's do: here one
    first = 2**16 - 2  # steps 2^16 - 1, 2^16 (tag 0), 2^16 + 1
    for ex in exchanges:
        ex.step.fill_(first - 1)
    for step in range(first, first + 3):
        for ex in exchanges:
            ex.begin_step()
        xs = [rand(1, k_in) for _ in range(size)]
        partials = [kernels.gemv(x, w) for x, w in zip(xs, w_in, strict=True)]
        total = torch.zeros(1, width, device=DEVICE)
        for p in partials:
            total += p.float()
        want = total.to(dtype)
        for r, ex in enumerate(exchanges):
            for q in range(r + 1, size):  # the peers yet to run: their words, as they write
                ex.words[point, q] = tagged(partials[q][0], step, ex.words.dtype)
            got = kernels.gemv(xs[r], w_in[r], send=Point(ex, point))
            assert got.data_ptr() == Point(ex, point).local_row.data_ptr()
            assert torch.equal(got, want), (step, r)
        for ex in exchanges:  # every peer's row, as its kernel wrote it here
            for q in range(size):
                if q != ex.rank:
                    expected = tagged(partials[q][0], step, ex.words.dtype)
                    assert torch.equal(ex.words[point, q], expected), (step, ex.rank, q)


def test_the_exchange_refuses_what_it_cannot_carry() -> None:
    ex = group(2, 16, torch.float32)[0]
    with pytest.raises(ValueError, match="point 3 of an exchange of 3"):
        Point(ex, 3)
    w = torch.zeros(16, 8, device=DEVICE)
    with pytest.raises(ValueError, match="sends one row"):
        kernels.gemv(torch.zeros(2, 8, device=DEVICE), w, send=Point(ex, 0))
    with pytest.raises(ValueError, match="twice the rows' width"):
        PeerExchange(0, ex.rows, ex.words.int(), ex.word_ptrs)
