"""The migration transport interface, and the pool memory each engine role exports.

What the migration protocol (sender.py, receiver.py) needs of a transport: open a
peer's pool from its descriptor, submit a batch of byte-range copies from the local pool
into it, and poll or wait on the ticket. lmd._native's HostTransport and
CudaIpcTransport fit (native.py); fake.py is an in-process one for unit tests; nixl/
(NVIDIA NIXL over UCX: shared memory, TCP, cuda_ipc, RDMA) fits the same verbs. This
module knows none of them: transports.py picks one.

`PoolMemory` is an engine's KV pool as a transport sees it:
  - host (CPU pools): the pool lives in a region the transport creates (native: shared
    memory a peer process maps; nixl: host memory registered with its agent);
  - cuda_ipc (GPU pools): the pool tensor is allocated as usual, then registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from lmd.engine.kv_pool import KVPool, PoolBuffer

Copy = tuple[int, int, int]  # (src_offset, dst_offset, nbytes)


class TicketLike(Protocol):
    """A submitted batch of copies; poll/wait raise RuntimeError if the batch failed."""

    @property
    def nbytes(self) -> int: ...

    def poll(self) -> bool: ...

    def wait(self, timeout_s: float | None = None) -> bool: ...


class LocalRegion(Protocol):
    @property
    def size(self) -> int: ...

    def descriptor(self) -> bytes: ...

    def close(self) -> None: ...


class PeerRegion(Protocol):
    @property
    def size(self) -> int: ...

    def close(self) -> None: ...


class MigrationTransport(Protocol):
    @property
    def name(self) -> str: ...

    def create_region(self, size: int) -> Any: ...  # a LocalRegion peers can open

    def register(self, ptr: int, size: int, device: str) -> Any: ...  # a LocalRegion

    def open(self, descriptor: bytes) -> Any: ...  # a PeerRegion of this transport

    def submit(
        self,
        src: Any,  # a LocalRegion of this transport
        dst: Any,  # a PeerRegion it opened
        copies: Sequence[Copy],
        wait_stream: int | None = None,
    ) -> TicketLike: ...

    def close(self) -> None: ...


class PoolMemory:
    """An engine's KV pool registered with a migration transport.

    Life cycle: made by transports.pool_memory for the engine's device; `buffer(nbytes)`
    is handed to Engine.build (host: the shared region the
    pool will view; cuda_ipc: None, the pool allocates on the GPU); `attach(pool)` once
    the pool exists registers it (cuda_ipc); `region` is then what copies read from or
    peers write into; `close()` on exit.
    """

    def __init__(self, transport: MigrationTransport, kind: str, device: str) -> None:
        self.transport = transport
        self.kind = kind
        self.device = device
        self.region: Any = None  # LocalRegion once the pool exists

    def buffer(self, nbytes: int) -> PoolBuffer | None:
        if self.kind != "host":
            return None
        self.region = self.transport.create_region(nbytes)
        return memoryview(self.region)

    def attach(self, pool: KVPool) -> None:
        if self.region is not None:
            return
        self.region = self.transport.register(pool.data_ptr, pool.nbytes, str(pool.device))

    @property
    def descriptor(self) -> bytes:
        if self.region is None:
            raise RuntimeError("the pool is not registered yet")
        return bytes(self.region.descriptor())

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
        self.transport.close()
