"""lmd._native's cuda_ipc transport: byte-exact copies between two processes on one GPU
and, where two GPUs are present, across GPUs. Skipped without CUDA.

The parent plays decode (its pool tensor is registered and exported); a spawned child
plays prefill (it opens the descriptor, passed as hex text, and pushes copies from its
own tensor). Only plain values cross the pipe.
"""

from __future__ import annotations

import functools
import random
from multiprocessing.connection import Connection

import pytest

from lmd import _native
from lmd.migration.bench_native import measure_cuda_ipc
from lmd.migration.native import block_copies, make_transport, register_tensor
from tests.processes import run_in_child as _run_in_child

PROBE = _native.probe_cuda()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not PROBE["available"], reason=f"no CUDA: {PROBE['reason']}"),
]
two_gpus = pytest.mark.skipif(PROBE["devices"] < 2, reason="needs two GPUs")

SENTINEL = 0xEE
SRC_SIZE = 24 << 20
DST_SIZE = (32 << 20) + 3
CHILD_TIMEOUT_S = 120.0
# CUDA contexts torn down at a child's exit need not give a clean exit code.
run_in_child = functools.partial(_run_in_child, timeout=CHILD_TIMEOUT_S, check_exit=False)

Copy = tuple[int, int, int]


def _batches(seed: int) -> list[list[Copy]]:
    """Single copies of many sizes at odd offsets, a scattered batch, a merged run."""
    rng = random.Random(seed)
    batches = []
    for n in [1, 3, 64, 4095, 4097, 65537, (1 << 20) + 13, 8 << 20]:
        s = rng.randrange(0, SRC_SIZE - n) | 1
        d = rng.randrange(0, DST_SIZE - n - 1) | 1
        batches.append([(s, d, n)])
    block = 128 << 10
    order = rng.sample(range(DST_SIZE // block), 128)
    batches.append(block_copies(list(range(128)), order, block))
    # Many unaligned ranges (the kernel's byte path), and ranges longer than one chunk.
    slots = rng.sample(range(DST_SIZE // 4096), 300)
    batches.append(
        [(rng.randrange(0, SRC_SIZE - 4096) | 1, s * 4096 + 3, 1000 + s % 7) for s in slots]
    )
    batches.append([(0, 1, (1 << 20) + 7), ((2 << 20) + 16, (4 << 20) + 16, (3 << 20) + 32)])
    # A run contiguous on both sides: merged into one copy.
    batches.append([(i * 4096, (16 << 20) + i * 4096, 4096) for i in range(512)])
    return batches


def _source_bytes(seed: int) -> bytes:
    return random.Random(seed).randbytes(SRC_SIZE)


def _child_push(
    conn: Connection, device: str, descriptor_hex: str, seed: int, copy_kernel: bool
) -> None:
    """Push every batch from a tensor on `device` into the parent's pool."""
    try:
        import torch

        data = bytearray(_source_bytes(seed))
        src_tensor = torch.frombuffer(data, dtype=torch.uint8).to(device, non_blocking=True)
        stream = torch.cuda.current_stream(device).cuda_stream
        with make_transport("cuda_ipc", device=device, copy_kernel=copy_kernel) as transport:
            src = register_tensor(transport, src_tensor)
            peer = transport.open(bytes.fromhex(descriptor_hex))
            moved = []
            for i, batch in enumerate(_batches(seed)):
                # The first batch waits for the upload on torch's stream.
                ticket = transport.submit(src, peer, batch, wait_stream=stream if i == 0 else None)
                assert ticket.wait(30.0)
                moved.append(ticket.nbytes)
            with pytest.raises(ValueError, match="past the end of the destination"):
                transport.submit(src, peer, [(0, 0, 16), (0, DST_SIZE - 1, 2)])
            peer.close()
            peer.close()
            src.close()
        conn.send(("ok", moved))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _push_and_check(src_device: str, dst_device: str, copy_kernel: bool) -> None:
    import torch

    pool = torch.full((DST_SIZE,), SENTINEL, dtype=torch.uint8, device=dst_device)
    torch.cuda.synchronize(dst_device)
    with make_transport("cuda_ipc", device=dst_device) as transport:
        region = register_tensor(transport, pool)
        seed = 3
        descriptor = region.descriptor().hex()
        moved = run_in_child(_child_push, src_device, descriptor, seed, copy_kernel)
        torch.cuda.synchronize(dst_device)
        region.close()
    src = _source_bytes(seed)
    expected = bytearray([SENTINEL]) * DST_SIZE
    for batch in _batches(seed):
        for s, d, n in batch:
            expected[d : d + n] = src[s : s + n]
    assert moved == [sum(n for _, _, n in batch) for batch in _batches(seed)]
    assert bytes(pool.cpu().numpy().tobytes()) == bytes(expected)


@pytest.mark.parametrize("copy_kernel", [True, False], ids=["kernel", "copy-engine"])
def test_two_processes_on_one_gpu_byte_exact(copy_kernel: bool) -> None:
    _push_and_check("cuda:0", "cuda:0", copy_kernel)


@two_gpus
@pytest.mark.parametrize("copy_kernel", [True, False], ids=["kernel", "copy-engine"])
def test_two_processes_across_gpus_byte_exact(copy_kernel: bool) -> None:
    _push_and_check("cuda:0", "cuda:1", copy_kernel)


def test_same_process_loopback_and_validation() -> None:
    import torch

    src_tensor = torch.arange(1 << 20, dtype=torch.int32, device="cuda:0")
    dst_tensor = torch.zeros(1 << 20, dtype=torch.int32, device="cuda:0")
    torch.cuda.synchronize()
    with make_transport("cuda_ipc", device="cuda:0") as transport:
        src = register_tensor(transport, src_tensor)
        dst = register_tensor(transport, dst_tensor)
        peer = transport.open(dst.descriptor())  # this process's own: used directly
        copies = block_copies([0, 1, 5], [3, 4, 0], 4096)
        assert transport.submit(src, peer, copies).wait(10.0)
        expected = torch.zeros_like(dst_tensor)
        for s, d, n in copies:
            expected[d // 4 : (d + n) // 4] = src_tensor[s // 4 : (s + n) // 4]
        assert torch.equal(dst_tensor, expected)
        with pytest.raises(ValueError, match="past the end"):
            transport.submit(src, peer, [(0, (4 << 20) - 4, 8)])
        with pytest.raises(ValueError, match="not CUDA device memory"):
            transport.register(torch.zeros(4).data_ptr(), 16, "cuda:0")
        with pytest.raises(ValueError, match="register memory of that device, not cpu"):
            transport.register(src_tensor.data_ptr(), 16, "cpu")
        with pytest.raises(BufferError):
            memoryview(src)
        with pytest.raises(ValueError, match="does not allocate"):
            transport.create_region(4096)
        peer.close()
        src.close()
        dst.close()
    with pytest.raises(ValueError, match="'cuda:N'"):
        _native.CudaIpcTransport("cuda:99")


def test_benchmark_moves_verified_bytes_on_one_gpu() -> None:
    result = measure_cuda_ipc(16, 128, repeats=2)
    assert (result["transport"], result["bytes"], result["blocks"]) == ("cuda_ipc", 16 << 20, 128)
    assert result["gbps"] > 0 and result["memcpy_gbps"] > 0
