"""Typed facade over lmd._native, the C++ KV transfer engine (native/transport.h).

Life cycle of one migration link (push, decode-first; docs/architecture.md §6):
  1. decode: allocates its pool as an exportable region, `transport.create_region(nbytes)`
     on the host transport (its KVPool views `memoryview(region)`), or registers the pool
     tensor, `register_tensor(transport, kv)` on cuda_ipc; sends `region.descriptor()`
     to each prefill worker once.
  2. prefill: `peer = transport.open(descriptor)` once per decode worker; its own pool
     is a region of the same transport.
  3. prefill, per request: `ticket = transport.submit(src, peer, block_copies(src_ids,
     dst_ids, block_nbytes))`; the copies run on native threads (host) or a dedicated
     CUDA stream (cuda_ipc) while Python goes on; `ticket.poll()` from the loop or
     `ticket.wait(timeout_s)`, then `migrated` goes to decode.
  4. either side: `close()` regions and transport on exit (idempotent). A mapping keeps
     the peer's memory alive until it is closed too; a copy still in flight into a closed
     region lands in scratch memory, never in freed memory.

Every submit validates each copy against both region sizes before any byte moves
(ValueError naming the copy). Copies of one batch may run in parallel: their
destination ranges must not overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, get_args, overload

from lmd._native import (
    CudaIpcTransport,
    HostTransport,
    Region,
    RemoteRegion,
    Ticket,
    Transport,
    probe_cuda,
)

__all__ = [
    "TRANSPORT_KINDS",
    "Copy",
    "CudaIpcTransport",
    "HostTransport",
    "Region",
    "RemoteRegion",
    "TensorLike",
    "Ticket",
    "Transport",
    "TransportKind",
    "available_transports",
    "block_copies",
    "make_transport",
    "probe_cuda",
    "register_tensor",
]

TransportKind = Literal["host", "cuda_ipc"]
TRANSPORT_KINDS: tuple[TransportKind, ...] = get_args(TransportKind)

# (src_offset, dst_offset, nbytes): one contiguous copy, in bytes from each region's start.
Copy = tuple[int, int, int]


class TensorLike(Protocol):
    """What register_tensor needs of a tensor (torch.Tensor fits)."""

    @property
    def device(self) -> object: ...  # str() gives "cpu" or "cuda:N"

    @property
    def nbytes(self) -> int: ...

    def data_ptr(self) -> int: ...

    def is_contiguous(self) -> bool: ...


def available_transports() -> list[TransportKind]:
    """Transports this machine can run: host always, cuda_ipc where CUDA works."""
    kinds: list[TransportKind] = ["host"]
    if probe_cuda()["available"]:
        kinds.append("cuda_ipc")
    return kinds


@overload
def make_transport(
    kind: Literal["host"], *, device: str = "cpu", num_threads: int = 0, copy_kernel: bool = True
) -> HostTransport: ...
@overload
def make_transport(
    kind: Literal["cuda_ipc"], *, device: str, num_threads: int = 0, copy_kernel: bool = True
) -> CudaIpcTransport: ...
@overload
def make_transport(
    kind: str, *, device: str = "cpu", num_threads: int = 0, copy_kernel: bool = True
) -> Transport: ...
def make_transport(
    kind: str, *, device: str = "cpu", num_threads: int = 0, copy_kernel: bool = True
) -> Transport:
    """A transport of `kind` copying on `device`.

    host: `device` must be "cpu"; `num_threads` copy threads (0: one per core, at most 8).
    cuda_ipc: `device` is "cuda:N"; RuntimeError says why when CUDA is unusable. A batch
    of several ranges runs as a few launches of a copy kernel (`copy_kernel=False`: one
    cuMemcpyAsync per range on the copy engines, no SMs taken, but host CPU time for
    every range: docs/benchmarks.md, 'Figures that code comments used to quote').
    """
    if kind == "host":
        if device != "cpu":
            raise ValueError(f"the host transport copies cpu memory, not {device}")
        if num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {num_threads}")
        return HostTransport(num_threads)
    if kind == "cuda_ipc":
        return CudaIpcTransport(device, copy_kernel=copy_kernel)
    raise ValueError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORT_KINDS)}")


def register_tensor(transport: Transport, tensor: TensorLike) -> Region:
    """Register a contiguous tensor's memory; the tensor must outlive the region.

    On the host transport such a region can only be a copy source (it is not shared
    memory); a pool that peers write into comes from `transport.create_region`.
    """
    if not tensor.is_contiguous():
        raise ValueError("register a contiguous tensor: a region is one byte range")
    return transport.register(tensor.data_ptr(), tensor.nbytes, str(tensor.device))


def block_copies(
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    block_nbytes: int,
    *,
    src_base: int = 0,
    dst_base: int = 0,
) -> list[Copy]:
    """Copies moving block src_ids[i] to dst_ids[i] in block-major pools.

    Block b starts at base + b * block_nbytes. Runs of ids consecutive on both sides
    merge into one copy, so a migration goes as few large ranges as the ids allow.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if block_nbytes < 1:
        raise ValueError(f"block_nbytes must be >= 1, got {block_nbytes}")
    copies: list[Copy] = []
    previous_src = previous_dst = -2
    for src, dst in zip(src_ids, dst_ids, strict=True):
        if src < 0 or dst < 0:
            raise ValueError(f"block ids must be >= 0, got {src} -> {dst}")
        if copies and src == previous_src + 1 and dst == previous_dst + 1:
            src_offset, dst_offset, length = copies[-1]
            copies[-1] = (src_offset, dst_offset, length + block_nbytes)
        else:
            copies.append(
                (src_base + src * block_nbytes, dst_base + dst * block_nbytes, block_nbytes)
            )
        previous_src, previous_dst = src, dst
    return copies
