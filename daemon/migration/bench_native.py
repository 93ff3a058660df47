"""Migration benchmarks of the transports between two real processes.

`measure_host(size_mb, block_kb)`, `measure_cuda_ipc(size_mb, block_kb, ...)` (lmd._native)
and `measure_nixl(size_mb, block_kb, ...)` (lmd.migration.nixl): this process plays
decode (it allocates the destination pool and exports it); a spawned child plays prefill
(it opens the pool, fills its own source pool with random bytes and pushes every block,
in one submit, to a shuffled destination block, as a migration into a fragmented decode
pool would). The child times submit + wait: one warm-up batch, then the median of
`repeats`. The bytes are verified afterwards, outside the timing.

For comparison, `memcpy_gbps` copies the same number of bytes inside one process: one
memcpy thread between two warm buffers (cpu pools), or a torch device copy from the
source device to the destination device (GPU pools). GB/s are one-way: bytes / seconds / 1e9.
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import os
import random
import statistics
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

from lmd.migration.native import (
    Copy,
    HostTransport,
    Region,
    make_transport,
    register_tensor,
)

if TYPE_CHECKING:
    import torch

# How long the parent waits for the child's figures before giving up.
CHILD_TIMEOUT_S = 300.0


class Measurement(TypedDict):
    transport: str
    bytes: int
    blocks: int
    seconds: float  # median of the timed batches, submit to completion
    gbps: float
    memcpy_gbps: float  # the same bytes copied inside one process (module docstring)
    src_device: str
    dst_device: str
    threads: int  # copy threads of the host transport; 0 for cuda_ipc


class _Job(NamedTuple):
    """What the child needs (plain values: spawn pickles them)."""

    kind: str
    descriptor: bytes
    device: str  # where the child's source pool lives
    block_nbytes: int
    repeats: int
    threads: int
    seed: int
    copy_kernel: bool = True


def shuffled_copies(num_blocks: int, block_nbytes: int, seed: int) -> tuple[list[int], list[Copy]]:
    """Block i of the source goes to block order[i] of the destination."""
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    copies = [(i * block_nbytes, dst * block_nbytes, block_nbytes) for i, dst in enumerate(order)]
    return order, copies


def _digest_in_order(buffer: memoryview, blocks: list[int], block_nbytes: int) -> str:
    h = hashlib.blake2b(digest_size=32)
    for b in blocks:
        h.update(buffer[b * block_nbytes : (b + 1) * block_nbytes])
    return h.hexdigest()


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A copy of a tensor's bytes on the CPU (no numpy needed)."""
    cpu = tensor.detach().to("cpu").contiguous()
    return memoryview(ctypes.string_at(cpu.data_ptr(), cpu.nbytes))


def _source(job: _Job, transport: Any, nbytes: int) -> tuple[Region, memoryview]:
    """The child's source pool, full of random bytes, and a CPU view of its contents."""
    if job.device == "cpu":
        src = transport.create_region(nbytes)
        memoryview(src)[:] = os.urandom(nbytes)
        return src, memoryview(src)
    import torch

    data = torch.frombuffer(bytearray(os.urandom(nbytes)), dtype=torch.uint8).to(job.device)
    torch.cuda.synchronize(job.device)  # the copies run on another stream
    return register_tensor(transport, data), _host_bytes(data)


def _transport(job: _Job) -> Any:
    """The child's transport (a native Transport or a NixlTransport)."""
    if job.kind == "nixl":
        from lmd.migration.nixl import NixlTransport

        return NixlTransport()
    return make_transport(
        job.kind, device=job.device, num_threads=job.threads, copy_kernel=job.copy_kernel
    )


def _sender(conn: Connection, job: _Job) -> None:
    """The child: push the whole pool into the peer `repeats + 1` times, report timings."""
    try:
        with _transport(job) as transport:
            if job.kind == "nixl" and job.device != "cpu":
                import torch

                # UCX takes cuda_ipc only for a peer loaded once this process has a
                # CUDA context (else it emulates GPU writes over TCP): make it first.
                torch.zeros(1, device=job.device)
            peer = transport.open(job.descriptor)
            src, contents = _source(job, transport, peer.size)
            num_blocks = peer.size // job.block_nbytes
            _, copies = shuffled_copies(num_blocks, job.block_nbytes, job.seed)
            seconds = []
            for _ in range(job.repeats + 1):
                start = time.perf_counter()
                transport.submit(src, peer, copies).wait()
                seconds.append(time.perf_counter() - start)
            digest = _digest_in_order(contents, list(range(num_blocks)), job.block_nbytes)
            contents.release()
            src.close()
            peer.close()
            threads = transport.num_threads if isinstance(transport, HostTransport) else 0
        conn.send(("ok", seconds[1:], digest, threads))
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}", "", 0))
    finally:
        conn.close()


def _run_sender(job: _Job) -> tuple[list[float], str, int]:
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_sender, args=(sender, job), daemon=True)
    child.start()
    sender.close()
    try:
        if not receiver.poll(CHILD_TIMEOUT_S):
            raise RuntimeError(f"benchmark child sent nothing within {CHILD_TIMEOUT_S:.0f} s")
        status, seconds, digest, threads = receiver.recv()
    except EOFError:
        raise RuntimeError(f"benchmark child died (exit code {child.exitcode})") from None
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    if status != "ok":
        raise RuntimeError(f"benchmark child failed: {seconds}")
    return seconds, digest, threads


def _check_sizes(size_mb: int, block_kb: int, repeats: int) -> tuple[int, int]:
    nbytes, block_nbytes = size_mb << 20, block_kb << 10
    if size_mb < 1 or block_kb < 1 or nbytes % block_nbytes:
        raise ValueError(
            f"size_mb={size_mb} must be a positive multiple of block_kb={block_kb} KiB"
        )
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return nbytes, block_nbytes


def _verify(contents: memoryview, digest: str, block_nbytes: int, seed: int) -> None:
    order, _ = shuffled_copies(len(contents) // block_nbytes, block_nbytes, seed)
    if _digest_in_order(contents, order, block_nbytes) != digest:
        raise RuntimeError("the transport delivered wrong bytes")


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """One-thread copy bandwidth of `nbytes` between two warm buffers, median of repeats."""
    src = memoryview(bytearray(os.urandom(nbytes)))
    dst = memoryview(bytearray(nbytes))
    dst[:] = src  # warm-up: faults the destination pages in
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst[:] = src
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds) / 1e9


def torch_copy_gbps(nbytes: int, src_device: str, dst_device: str, repeats: int = 5) -> float:
    """torch copy bandwidth of `nbytes` from src_device to dst_device, median of repeats."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    dst.copy_(src)  # warm-up: peer access, allocator
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize(src_device)
        torch.cuda.synchronize(dst_device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(src_device)
        torch.cuda.synchronize(dst_device)
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds) / 1e9


def _result(
    kind: str, nbytes: int, block_nbytes: int, seconds: list[float], local_gbps: float
) -> Measurement:
    median = statistics.median(seconds)
    return Measurement(
        transport=kind,
        bytes=nbytes,
        blocks=nbytes // block_nbytes,
        seconds=median,
        gbps=nbytes / median / 1e9,
        memcpy_gbps=local_gbps,
        src_device="cpu",
        dst_device="cpu",
        threads=0,
    )


def measure_host(
    size_mb: int, block_kb: int, *, repeats: int = 5, num_threads: int = 0, seed: int = 0
) -> Measurement:
    """Move `size_mb` MiB in `block_kb` KiB blocks from a child process into this one."""
    nbytes, block_nbytes = _check_sizes(size_mb, block_kb, repeats)
    with make_transport("host") as transport, transport.create_region(nbytes) as dst:
        job = _Job("host", dst.descriptor(), "cpu", block_nbytes, repeats, num_threads, seed)
        seconds, digest, threads = _run_sender(job)
        with memoryview(dst) as contents:
            _verify(contents, digest, block_nbytes, seed)
    result = _result("host", nbytes, block_nbytes, seconds, memcpy_gbps(nbytes, repeats))
    result["threads"] = threads
    return result


def measure_cuda_ipc(
    size_mb: int,
    block_kb: int,
    *,
    src_device: str = "cuda:0",
    dst_device: str = "cuda:0",
    repeats: int = 5,
    seed: int = 0,
    copy_kernel: bool = True,
) -> Measurement:
    """Like measure_host, GPU to GPU: the child's pool on src_device, ours on dst_device.

    `copy_kernel=False` measures one cuMemcpyAsync per range instead of the copy kernel.
    """
    import torch

    nbytes, block_nbytes = _check_sizes(size_mb, block_kb, repeats)
    pool = torch.zeros(nbytes, dtype=torch.uint8, device=dst_device)
    with (
        make_transport("cuda_ipc", device=dst_device) as transport,
        register_tensor(transport, pool) as dst,
    ):
        job = _Job(
            "cuda_ipc", dst.descriptor(), src_device, block_nbytes, repeats, 0, seed, copy_kernel
        )
        seconds, digest, _ = _run_sender(job)
        _verify(_host_bytes(pool), digest, block_nbytes, seed)
    local = torch_copy_gbps(nbytes, src_device, dst_device, repeats)
    result = _result("cuda_ipc", nbytes, block_nbytes, seconds, local)
    result["src_device"], result["dst_device"] = src_device, dst_device
    return result


def measure_nixl(
    size_mb: int,
    block_kb: int,
    *,
    src_device: str = "cpu",
    dst_device: str = "cpu",
    repeats: int = 5,
    seed: int = 0,
) -> Measurement:
    """Like measure_host through NIXL (UCX picks the path: shared memory or TCP between
    host pools, cuda_ipc or RDMA between GPU pools; UCX_TLS narrows it)."""
    from lmd.migration.nixl import NixlTransport

    nbytes, block_nbytes = _check_sizes(size_mb, block_kb, repeats)

    def job(descriptor: bytes) -> _Job:
        return _Job("nixl", descriptor, src_device, block_nbytes, repeats, 0, seed)

    with NixlTransport() as transport:
        if dst_device == "cpu":
            host = transport.create_region(nbytes)
            seconds, digest, _ = _run_sender(job(host.descriptor()))
            _verify(memoryview(host), digest, block_nbytes, seed)
        else:
            import torch

            pool = torch.zeros(nbytes, dtype=torch.uint8, device=dst_device)
            dst = transport.register(pool.data_ptr(), nbytes, dst_device)
            seconds, digest, _ = _run_sender(job(dst.descriptor()))
            _verify(_host_bytes(pool), digest, block_nbytes, seed)
    if src_device == dst_device == "cpu":
        local = memcpy_gbps(nbytes, repeats)
    else:
        local = torch_copy_gbps(nbytes, src_device, dst_device, repeats)
    result = _result("nixl", nbytes, block_nbytes, seconds, local)
    result["src_device"], result["dst_device"] = src_device, dst_device
    return result
