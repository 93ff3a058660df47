"""An in-process migration transport for unit tests: same verbs as lmd._native's.

Regions are bytearrays registered in a process-wide table under their descriptor, so a
"peer" in the same process opens them. Submit checks every copy against both regions
before any byte moves (ValueError, as the native transports). Copies run at once, or,
with `hold=True`, wait until `complete_held()`: a test can abort or time out a request
while its copy is in flight. `fail_next` makes the next batch fail (RuntimeError on
poll/wait, like a failed native batch).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import ClassVar

from lmd.migration.base import Copy

_DESCRIPTOR_PREFIX = b"fake-region:"


class FakeRegion(bytearray):
    """Local memory: a bytearray with the region verbs."""

    transport_name = "fake"

    def __init__(self, size: int, descriptor: bytes) -> None:
        super().__init__(size)
        self._descriptor = descriptor
        self.closed = False

    @property
    def size(self) -> int:
        return len(self)

    def descriptor(self) -> bytes:
        if self.closed:
            raise ValueError("region is closed")
        return self._descriptor

    def close(self) -> None:
        self.closed = True
        FakeTransport.regions.pop(self._descriptor, None)


class FakePeer:
    """A peer's region opened from its descriptor."""

    def __init__(self, region: FakeRegion) -> None:
        self.region = region
        self.closed = False

    @property
    def size(self) -> int:
        return len(self.region)

    def close(self) -> None:
        self.closed = True


class FakeTicket:
    def __init__(self, nbytes: int, pending: list[tuple[FakeRegion, FakeRegion, Copy]]) -> None:
        self.nbytes = nbytes
        self._pending = pending
        self.failed = False

    @property
    def done(self) -> bool:
        return not self._pending

    def run(self) -> None:
        for src, dst, (src_offset, dst_offset, length) in self._pending:
            dst[dst_offset : dst_offset + length] = src[src_offset : src_offset + length]
        self._pending = []

    def poll(self) -> bool:
        if self.failed:
            raise RuntimeError("fake copy batch failed")
        return self.done

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.poll()


class FakeTransport:
    name = "fake"
    regions: ClassVar[dict[bytes, FakeRegion]] = {}
    _ids = itertools.count()

    def __init__(self, *, hold: bool = False) -> None:
        self.hold = hold
        self.fail_next = False
        self.held: list[FakeTicket] = []
        self.submitted: list[Sequence[Copy]] = []

    def create_region(self, size: int) -> FakeRegion:
        if size < 1:
            raise ValueError(f"region size must be >= 1, got {size}")
        descriptor = _DESCRIPTOR_PREFIX + str(next(self._ids)).encode()
        region = FakeRegion(size, descriptor)
        self.regions[descriptor] = region
        return region

    def register(self, ptr: int, size: int, device: str) -> FakeRegion:
        raise ValueError("the fake transport only creates regions")

    def open(self, descriptor: bytes) -> FakePeer:
        region = self.regions.get(descriptor)
        if region is None:
            raise ValueError(f"no region {descriptor[:40]!r}")
        return FakePeer(region)

    def submit(
        self,
        src: FakeRegion,
        dst: FakePeer,
        copies: Sequence[Copy],
        wait_stream: int | None = None,
    ) -> FakeTicket:
        if not isinstance(src, FakeRegion) or not isinstance(dst, FakePeer):
            raise ValueError("regions of another transport")
        if src.closed or dst.closed:
            raise ValueError("region is closed")
        for i, (src_offset, dst_offset, length) in enumerate(copies):
            if length < 1 or src_offset < 0 or dst_offset < 0:
                raise ValueError(f"copy {i}: offsets must be >= 0 and length >= 1")
            if src_offset + length > src.size or dst_offset + length > dst.size:
                raise ValueError(f"copy {i} is out of range")
        spans = sorted((d, d + n) for _, d, n in copies)
        if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
            raise ValueError("destination ranges overlap")
        self.submitted.append(list(copies))
        ticket = FakeTicket(sum(n for _, _, n in copies), [(src, dst.region, c) for c in copies])
        if self.fail_next:
            self.fail_next = False
            ticket.failed = True
        elif self.hold:
            self.held.append(ticket)
        else:
            ticket.run()
        return ticket

    def complete_held(self) -> None:
        for ticket in self.held:
            ticket.run()
        self.held = []

    def close(self) -> None:
        pass
