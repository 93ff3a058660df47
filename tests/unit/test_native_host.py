"""lmd._native's host transport between real processes, and its Python facade.

The parent plays decode (it creates the shared destination pool); a spawned child plays
prefill (it opens the descriptor, passed as hex text, and pushes copies). Only plain
values cross the pipe: native objects are never pickled. torch is imported inside the
tests that use it, so that the spawned children (which import this module) start fast.
"""

from __future__ import annotations

import ctypes
import os
import random
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from lmd import _native
from lmd.migration.bench_native import measure_host
from lmd.migration.native import block_copies, make_transport, register_tensor
from tests.processes import run_in_child

SENTINEL = 0xEE
SRC_SIZE = 6 << 20
DST_SIZE = (8 << 20) + 3  # odd on purpose
CHILD_TIMEOUT_S = 60.0

Copy = tuple[int, int, int]


# ----------------------------------------------------------------------------- children


def _child_push(
    conn: Connection, descriptor_hex: str, seed: int, batches: list[list[Copy]]
) -> None:
    """Fill a source region from `seed`, push each batch in order, report nbytes moved."""
    try:
        with _native.HostTransport() as transport:
            peer = transport.open(bytes.fromhex(descriptor_hex))
            src = transport.create_region(SRC_SIZE)
            memoryview(src)[:] = random.Random(seed).randbytes(SRC_SIZE)
            moved = []
            for batch in batches:
                ticket = transport.submit(src, peer, batch)
                assert ticket.wait(30.0)
                moved.append(ticket.nbytes)
            # An [N, 3] int64 array takes the same path without per-tuple conversion.
            ticket = transport.submit(src, peer, np.array([(0, 0, 8), (8, 8, 8)], dtype=np.int64))
            ticket.wait()
            moved.append(ticket.nbytes)
            src.close()
            peer.close()
            peer.close()
        conn.send(("ok", moved))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _child_bad_batches(conn: Connection, descriptor_hex: str, batches: list[list[Any]]) -> None:
    """Try each batch, report the exception class name each one raised."""
    try:
        with _native.HostTransport() as transport:
            peer = transport.open(bytes.fromhex(descriptor_hex))
            src = transport.create_region(SRC_SIZE)
            memoryview(src)[:] = b"\x11" * SRC_SIZE
            raised = []
            for batch in batches:
                try:
                    transport.submit(src, peer, batch).wait()
                    raised.append("nothing")
                except Exception as exc:
                    raised.append(f"{type(exc).__name__}: {exc}")
            src.close()
            peer.close()
        conn.send(("ok", raised))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _child_fds_after_close(conn: Connection, descriptor_hex: str) -> None:
    """Open, copy, close twice; report open fds before and after."""
    try:
        before = len(os.listdir("/proc/self/fd"))
        transport = _native.HostTransport()
        peer = transport.open(bytes.fromhex(descriptor_hex))
        src = transport.create_region(4096)
        transport.submit(src, peer, [(0, 0, 4096)]).wait()
        for _ in range(2):
            src.close()
            peer.close()
            transport.close()
        del src, peer, transport
        conn.send(("ok", (before, len(os.listdir("/proc/self/fd")))))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _child_export_and_exit(conn: Connection) -> None:
    """Create a region, send its descriptor, exit (the region dies with the process)."""
    with _native.HostTransport() as transport:
        region = transport.create_region(4096)
        conn.send(("ok", region.descriptor().hex()))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def transport() -> Iterator[_native.HostTransport]:
    with _native.HostTransport() as t:
        yield t


@pytest.fixture
def dst(transport: _native.HostTransport) -> Iterator[_native.Region]:
    region = transport.create_region(DST_SIZE)
    memoryview(region)[:] = bytes([SENTINEL]) * DST_SIZE
    yield region
    region.close()


def _apply(expected: bytearray, src: bytes, batch: list[Copy]) -> None:
    for s, d, n in batch:
        expected[d : d + n] = src[s : s + n]


def _single_copy_batches(rng: random.Random) -> list[list[Copy]]:
    sizes = [1, 2, 3, 7, 63, 64, 65, 511, 4095, 4096, 4097, 65537, 300_001, (1 << 20) + 13]
    batches = []
    for n in sizes:
        s = rng.randrange(0, SRC_SIZE - n) | 1  # odd offsets
        d = rng.randrange(0, DST_SIZE - n - 1) | 1
        batches.append([(s, d, n)])
    return batches


def _scattered_batch(rng: random.Random, count: int, length: int) -> list[Copy]:
    """`count` copies of `length` bytes into distinct shuffled destination slots."""
    slots = rng.sample(range(DST_SIZE // length), count)
    return [(rng.randrange(0, SRC_SIZE - length), slot * length + 0, length) for slot in slots]


# ----------------------------------------------------------------------------- tests


def test_region_is_a_writable_buffer_numpy_and_torch_can_view(
    transport: _native.HostTransport,
) -> None:
    import torch

    with transport.create_region(4096) as region:
        assert (region.size, region.device, region.transport) == (4096, "cpu", "host")
        view = memoryview(region)
        assert (view.nbytes, view.readonly, view.format) == (4096, False, "B")
        assert bytes(view[:8]) == b"\0" * 8  # zeroed
        np.frombuffer(memoryview(region), dtype=np.uint8)[:4] = [1, 2, 3, 4]
        floats = torch.frombuffer(region, dtype=torch.float32)
        assert floats.shape == (1024,)
        floats[1] = 1.5
        assert bytes(view[:4]) == b"\x01\x02\x03\x04"
        assert bytes(view[4:8]) == np.float32(1.5).tobytes()
        view.release()
        del floats


def test_exact_bytes_between_processes(dst: _native.Region) -> None:
    rng = random.Random(5)
    batches = _single_copy_batches(rng)
    batches.append(_scattered_batch(rng, 2000, 517))  # many copies, split over threads
    batches.append(_scattered_batch(rng, 48, 65536))
    # One op larger than a thread's share (split inside it), plus a few small ones.
    batches.append([(3, 1, (3 << 20) + 5), (SRC_SIZE - 9, DST_SIZE - 9, 9), (0, (4 << 20), 0)])
    # Runs contiguous on both sides merge into one copy.
    batches.append([(100 + i * 1000, 7_000_001 + i * 1000, 1000) for i in range(300)])
    seed = 11
    moved = run_in_child(_child_push, dst.descriptor().hex(), seed, batches)

    src = random.Random(seed).randbytes(SRC_SIZE)
    expected = bytearray([SENTINEL]) * DST_SIZE
    for batch in batches:
        _apply(expected, src, batch)
    _apply(expected, src, [(0, 0, 16)])
    assert moved == [sum(n for _, _, n in batch) for batch in batches] + [16]
    assert bytes(memoryview(dst)) == bytes(expected)


def test_out_of_range_copies_raise_value_error_and_write_nothing(dst: _native.Region) -> None:
    good = (0, 0, 4096)
    bad_batches: list[list[Any]] = [
        [good, (0, DST_SIZE - 10, 11)],  # one byte past the destination
        [good, (SRC_SIZE - 10, 0, 11)],  # one byte past the source
        [good, (DST_SIZE, 0, 1)],
        [good, (0, 2**63 - 1, 2**63 - 1)],  # offset + length overflows 64 bits
        [good, (0, 2**64, 1)],  # does not fit in 64 bits
        [good, (-1, 0, 1)],
        [good, (0, 0, -5)],
        [good, (0, 0)],
        [good, (0, 0, "8")],
    ]
    raised = run_in_child(_child_bad_batches, dst.descriptor().hex(), bad_batches)
    assert all(r.startswith("ValueError") for r in raised), raised
    assert "copy 1" in raised[0] and "writes past the end of the destination" in raised[0]
    assert "reads past the end of the source" in raised[1]
    assert bytes(memoryview(dst)) == bytes([SENTINEL]) * DST_SIZE


def test_close_twice_is_safe_and_leaves_no_fd_or_shm(transport: _native.HostTransport) -> None:
    shm_before = sorted(os.listdir("/dev/shm"))
    fds_before = len(os.listdir("/proc/self/fd"))
    region = transport.create_region(1 << 20)
    before, after = run_in_child(_child_fds_after_close, region.descriptor().hex())
    assert after == before  # the child's mapping left no fd behind
    peer = transport.open(region.descriptor())  # this same process can open it too
    region.close()
    region.close()
    peer.close()
    peer.close()
    assert region.closed and peer.closed
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert sorted(os.listdir("/dev/shm")) == shm_before
    with pytest.raises(ValueError, match="closed"):
        region.descriptor()
    with pytest.raises(BufferError):
        memoryview(region)
    src = transport.create_region(64)
    with pytest.raises(ValueError, match="destination region is closed"):
        transport.submit(src, peer, [(0, 0, 1)])


def test_views_and_copies_outliving_close_never_crash(transport: _native.HostTransport) -> None:
    region = transport.create_region(1 << 20)
    view = np.frombuffer(memoryview(region), dtype=np.uint8)
    peer = transport.open(region.descriptor())
    src = transport.create_region(1 << 20)
    ticket = transport.submit(src, peer, [(0, 0, 1 << 20)])
    peer.close()
    region.close()
    ticket.wait(10.0)
    view[:] = 7  # scratch memory now: harmless
    assert int(view.sum()) == 7 << 20


def test_descriptor_of_a_region_that_is_gone(transport: _native.HostTransport) -> None:
    descriptor_hex = run_in_child(_child_export_and_exit)
    with pytest.raises(RuntimeError, match="is gone"):
        transport.open(bytes.fromhex(descriptor_hex))
    region = transport.create_region(4096)
    descriptor = region.descriptor()
    region.close()
    with pytest.raises(RuntimeError, match="is gone"):
        transport.open(descriptor)


@pytest.mark.parametrize(
    ("descriptor", "message"),
    [
        (b"", "not an lmd region descriptor"),
        (b"garbage garbage", "not an lmd region descriptor"),
        (b"LMDR\x01\x02" + bytes(96), "for the cuda_ipc transport, not host"),
        (b"LMDR\x09\x01", "version 9"),
        (b"LMDR\x01\x01" + bytes(10), "has 16 bytes, expected"),
    ],
)
def test_malformed_descriptors_raise_value_error(
    transport: _native.HostTransport, descriptor: bytes, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        transport.open(descriptor)


def test_registered_memory_is_a_source_but_not_exportable(
    transport: _native.HostTransport,
) -> None:
    data = bytearray(os.urandom(10_000))
    address = ctypes.addressof(ctypes.c_char.from_buffer(data))
    with transport.create_region(10_000) as pool, transport.open(pool.descriptor()) as peer:
        source = transport.register(address, len(data), "cpu")
        assert not source.exportable
        with pytest.raises(ValueError, match="create_region"):
            source.descriptor()
        transport.submit(source, peer, [(0, 0, 10_000)]).wait()
        assert bytes(memoryview(pool)) == bytes(data)
        source.close()
    with pytest.raises(ValueError, match="cpu memory, not cuda:0"):
        transport.register(address, len(data), "cuda:0")


def test_bad_arguments_say_what_is_wrong(transport: _native.HostTransport) -> None:
    with transport.create_region(64) as pool, transport.open(pool.descriptor()) as peer:
        with pytest.raises(ValueError, match="takes none"):
            transport.submit(pool, peer, [(0, 0, 1)], wait_stream=0)
        with pytest.raises(TypeError, match="sequence of"):
            transport.submit(pool, peer, 5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"int64 of shape \[N, 3\]"):
            transport.submit(pool, peer, np.zeros((2, 2), dtype=np.int64))
        ticket = transport.submit(pool, peer, [])
        assert ticket.poll() and ticket.nbytes == 0
        with pytest.raises(ValueError, match="timeout_s"):
            ticket.wait(-1.0)
    with pytest.raises(ValueError, match="> 0 bytes"):
        transport.create_region(0)
    transport.close()
    transport.close()
    with pytest.raises(RuntimeError, match="transport is closed"):
        transport.create_region(64)


@pytest.mark.skipif(_native.probe_cuda()["available"], reason="this machine has CUDA")
def test_cuda_ipc_without_cuda_raises_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        _native.CudaIpcTransport("cuda:0")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        make_transport("cuda_ipc", device="cuda:0")


def test_block_copies_merge_runs_consecutive_on_both_sides() -> None:
    assert block_copies([0, 1, 2, 7, 8], [5, 6, 9, 3, 4], 10) == [
        (0, 50, 20),
        (20, 90, 10),
        (70, 30, 20),
    ]
    assert block_copies([3], [4], 8, src_base=1, dst_base=2) == [(25, 34, 8)]
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        block_copies([0, 1], [0], 8)
    with pytest.raises(ValueError, match=">= 0"):
        block_copies([-1], [0], 8)


def test_facade_registers_tensors_and_rejects_unknown_transports() -> None:
    import torch

    with make_transport("host", num_threads=2) as transport:
        assert transport.num_threads == 2
        tensor = torch.arange(16, dtype=torch.int32)
        region = register_tensor(transport, tensor)
        assert (region.ptr, region.size) == (tensor.data_ptr(), 64)
        with pytest.raises(ValueError, match="contiguous"):
            register_tensor(transport, torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="unknown transport 'rdma'"):
        make_transport("rdma")
    with pytest.raises(ValueError, match="cpu memory, not cuda:0"):
        make_transport("host", device="cuda:0")


def test_benchmark_moves_verified_bytes_between_processes() -> None:
    result = measure_host(4, 64, repeats=1)
    assert result["transport"] == "host"
    assert (result["bytes"], result["blocks"]) == (4 << 20, 64)
    assert result["seconds"] > 0 and result["gbps"] > 0 and result["memcpy_gbps"] > 0
