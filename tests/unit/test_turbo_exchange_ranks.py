"""The peer exchange's polls waiting for real (turbo/exchange.py): two ranks as two
processes on the CPU, Triton's interpreter in each (float16: it has no bfloat16),
forked after their buffers are put in shared memory (so each rank's pointer table names
the other's words at the same address). Each rank runs a model's order of products,
gemv's `send` at a point (which sums the row over the group) then a product on that
row, for four points and three steps across the tag's wrap; rank 1 pauses before each
send, so rank 0's send finds its words missing, or a step behind, and waits. Each
product equals the one on the sum made first, bit for bit.
(tests/unit/test_turbo_exchange.py covers the kernels on one process, with every peer's
words already written.)
"""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from tests.unit.test_turbo_kernels import ON_CUDA

pytest.importorskip("triton")
if ON_CUDA:
    pytest.skip("the interpreter's test: two CPU processes", allow_module_level=True)

from lmd.engine.turbo import kernels
from lmd.engine.turbo.exchange import WORDS, PeerExchange, Point

SIZE, POINTS, STEPS, K_IN, WIDTH, N_OUT = 2, 4, 3, 48, 40, 24
FIRST = 2**16 - 1  # the steps' counts: 2^16 - 1, 2^16 (tag 0), 2^16 + 1


def inputs(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rank `rank`'s weights (one a point) and input rows (one a step and point)."""
    gen = torch.Generator().manual_seed(rank)
    w_in = [torch.randn(WIDTH, K_IN, generator=gen) / K_IN**0.5 for _ in range(POINTS)]
    xs = [torch.randn(1, K_IN, generator=gen) for _ in range(STEPS * POINTS)]
    return [w.half() for w in w_in], [x.half() for x in xs]


def w_out() -> torch.Tensor:
    return (torch.randn(N_OUT, WIDTH, generator=torch.Generator().manual_seed(9)) / 7).half()


def shared(t: torch.Tensor) -> torch.Tensor:
    """t moved into shared memory (a forked rank sees it at the same address)."""
    t.share_memory_()  # type: ignore[no-untyped-call]  # torch's is untyped
    return t


def run_rank(exchange: PeerExchange, out: torch.Tensor) -> None:
    """A rank's steps: at each point its partial row sent, then the product on the sum."""
    torch.set_num_threads(1)
    (w_in, xs), w = inputs(exchange.rank), w_out()
    for step in range(STEPS):
        exchange.begin_step()
        for p in range(POINTS):
            point = Point(exchange, p)
            time.sleep(0.05 * exchange.rank)  # rank 0 then waits for rank 1's words
            row = kernels.gemv(xs[step * POINTS + p], w_in[p], send=point)
            out[step, p] = kernels.vector_gemv(row, w)[0]


def test_two_rank_processes_wait_for_each_others_rows() -> None:
    word = WORDS[2]
    words = [shared(torch.zeros(POINTS, SIZE, WIDTH, dtype=word)) for _ in range(SIZE)]
    ptrs = torch.tensor([t.data_ptr() for t in words], dtype=torch.int64)
    rows = [shared(torch.zeros(POINTS, WIDTH, dtype=torch.float16)) for _ in words]
    outs = [shared(torch.zeros(STEPS, POINTS, N_OUT, dtype=torch.float16)) for _ in words]
    exchanges = [PeerExchange(r, rows[r], words[r], ptrs) for r in range(SIZE)]
    for ex in exchanges:
        ex.step.fill_(FIRST - 1)
        shared(ex.step)
    fork = multiprocessing.get_context("fork")
    ranks = [fork.Process(target=run_rank, args=(ex, outs[ex.rank])) for ex in exchanges]
    for proc in ranks:
        proc.start()
    for proc in ranks:
        proc.join(300)
    hung = [proc for proc in ranks if proc.is_alive()]
    for proc in hung:
        proc.kill()
    assert not hung, "a rank never saw its peer's words"
    assert [proc.exitcode for proc in ranks] == [0] * SIZE
    per_rank = [inputs(r) for r in range(SIZE)]
    for step in range(STEPS):
        for p in range(POINTS):
            total = torch.zeros(1, WIDTH)
            for w_in, xs in per_rank:
                total += kernels.gemv(xs[step * POINTS + p], w_in[p]).float()
            want = kernels.vector_gemv(total.half(), w_out())[0]
            for out in outs:
                assert torch.equal(out[step, p], want), (step, p)
