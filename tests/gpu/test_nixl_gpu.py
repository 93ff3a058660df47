"""lmd.migration.nixl between two processes' GPU pools: the pool tensors registered as
VRAM with NIXL, UCX choosing the path itself (cuda_ipc on one host). Byte-exact
scattered blocks, the same code path as between host pools. Skipped without CUDA or
NIXL (`pip install lmd[cluster]`).

The parent plays decode (its pool tensor is registered, its descriptor sent as hex text);
a spawned child plays prefill (random bytes from a seed in its own GPU tensor, written
into shuffled destination blocks after the stream that filled them is synchronized).
"""

from __future__ import annotations

import functools
import random
from multiprocessing.connection import Connection

import pytest
import torch

from lmd.migration import nixl
from lmd.migration.nixl import NixlTransport
from tests.processes import run_in_child as _run_in_child

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed (lmd[cluster])"),
]
# CUDA contexts torn down at a child's exit need not give a clean exit code.
run_in_child = functools.partial(_run_in_child, timeout=120.0, check_exit=False)

BLOCK = 256 << 10
NUM_SRC, NUM_DST = 96, 131
SENTINEL = 0xEE


def _source_bytes(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (NUM_SRC * BLOCK,), dtype=torch.uint8, generator=generator)


def _plan(seed: int) -> list[tuple[int, int, int]]:
    """Source block i to a shuffled destination block, one (src, dst, nbytes) each, plus a
    run of 8 blocks consecutive on both sides as one range."""
    dst = random.Random(seed).sample(range(NUM_DST - 8), NUM_SRC - 8)
    copies = [(i * BLOCK, d * BLOCK, BLOCK) for i, d in enumerate(dst)]
    run = (NUM_DST - 8) * BLOCK
    copies.append(((NUM_SRC - 8) * BLOCK, run, 8 * BLOCK))
    return copies


def _prefill(conn: Connection, descriptor_hex: str, seed: int, device: str) -> None:
    try:
        with NixlTransport() as transport:
            # The local GPU region first: UCX picks cuda_ipc only for a peer loaded once
            # this process has a CUDA context (else it emulates the writes over TCP).
            src = _source_bytes(seed).to(device, non_blocking=True)
            region = transport.register(src.data_ptr(), src.nbytes, device)
            peer = transport.open(bytes.fromhex(descriptor_hex))
            stream = torch.cuda.current_stream(device).cuda_stream
            ticket = transport.submit(region, peer, _plan(seed), stream)
            assert ticket.wait(60.0), "the write did not finish"
            conn.send(("ok", ticket.nbytes))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("src_device", ["cuda:0", "cuda:1"])
def test_gpu_pools_get_exact_bytes(src_device: str) -> None:
    if torch.device(src_device).index >= torch.cuda.device_count():
        pytest.skip("needs two GPUs")
    seed = 11
    pool = torch.full((NUM_DST * BLOCK,), SENTINEL, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize("cuda:0")  # filled before the other process writes into it
    with NixlTransport() as transport:
        region = transport.register(pool.data_ptr(), pool.nbytes, "cuda:0")
        moved = run_in_child(_prefill, region.descriptor().hex(), seed, src_device)
        region.close()
    copies = _plan(seed)
    assert moved == sum(n for _, _, n in copies)
    expected = torch.full_like(pool, SENTINEL, device="cpu")
    source = _source_bytes(seed)
    for s, d, n in copies:
        expected[d : d + n] = source[s : s + n]
    assert torch.equal(pool.cpu(), expected)
