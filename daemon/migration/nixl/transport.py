"""NixlTransport: the migration transport verbs (base.MigrationTransport) over one Agent.

Regions are local memory registered with the agent, peers are other agents' regions
opened from their descriptors, tickets are posted writes. Life cycle: lmd.migration.nixl.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import secrets
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from lmd.migration.base import Copy
from lmd.migration.nixl import descriptor
from lmd.migration.nixl.agent import Agent
from lmd.migration.nixl.descriptor import Span

log = logging.getLogger(__name__)

NAME = "nixl"
MAX_POLL_SLEEP_S = 1e-3  # ticket.wait's longest sleep between two polls


class NixlRegion:
    """Local memory registered with an agent. From `register`: the caller keeps the
    memory alive (e.g. a GPU pool tensor) at least until the region is closed."""

    def __init__(self, agent: Agent, span: Span) -> None:
        self.agent = agent
        self.span = span
        self._key = agent.register(span)
        self.closed = False

    @property
    def size(self) -> int:
        return self.span.size

    def descriptor(self) -> bytes:
        if self.closed:
            raise ValueError("region is closed")
        return descriptor.encode(self.agent.name, self.agent.metadata(), self.span)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.agent.deregister(self._key)


class NixlHostRegion(NixlRegion, bytearray):
    """Host memory the transport allocated (zeroed) and registered; a writable buffer:
    the CPU KV pool views `memoryview(region)`. Its memory is freed only once nothing
    views it any more, so a late write never lands in freed memory."""

    def __init__(self, agent: Agent, size: int) -> None:
        if size < 1:
            raise ValueError(f"region size must be >= 1, got {size}")
        bytearray.__init__(self, size)
        # An export for life: a bytearray with one cannot be resized, so its memory
        # never moves away from the registered address.
        self._pin = memoryview(self)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self._pin))
        NixlRegion.__init__(self, agent, Span.on("cpu", addr, size))


class NixlPeer:
    """A peer's registered region, opened from its descriptor."""

    def __init__(self, transport: NixlTransport, agent: str, span: Span) -> None:
        self.transport = transport
        self.agent = agent  # the peer agent's name
        self.span = span
        self.closed = False

    @property
    def size(self) -> int:
        return self.span.size

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.forget(self.agent)


class NixlTicket:
    """A posted write. poll() and wait() raise RuntimeError if it failed (every later
    call too); once it is done its NIXL handle is released."""

    def __init__(self, agent: Agent, handle: int | None, nbytes: int) -> None:
        self.agent = agent
        self.handle = handle  # None once done and released
        self.nbytes = nbytes
        self.error = ""

    def poll(self) -> bool:
        """Whether the write is complete, without blocking."""
        if self.error:
            raise RuntimeError(self.error)
        if self.handle is None:
            return True
        try:
            done = self.agent.finished(self.handle)
        except RuntimeError as exc:
            self.abandon(str(exc))
            raise
        if done:
            self.release()
        return done

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once done, False if `timeout_s` passed first (the write may still land)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = 50e-6
        while not self.poll():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, MAX_POLL_SLEEP_S)
        return True

    def release(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            self.agent.release(handle)

    def abandon(self, error: str) -> None:
        """Fail the ticket for good and free its handle."""
        self.error = error
        self.release()


@dataclass(slots=True)
class _Remote:
    """A peer agent whose metadata is loaded."""

    metadata: bytes
    num_peers: int = 0  # its NixlPeers still open


class NixlTransport:
    """One NIXL agent (UCX backend), named lmd-<pid>-<random>, and what it holds."""

    name = NAME

    def __init__(self) -> None:
        self.agent = Agent(f"lmd-{os.getpid()}-{secrets.token_hex(4)}")
        self._remotes: dict[str, _Remote] = {}  # by agent name
        self._tickets: weakref.WeakSet[NixlTicket] = weakref.WeakSet()  # in flight
        self._uses_gpu = False  # a GPU region is registered: the process has a CUDA context
        self.closed = False

    @property
    def agent_name(self) -> str:
        return self.agent.name

    def create_region(self, size: int) -> NixlHostRegion:
        """Host memory peers can write into."""
        self._check_open()
        return NixlHostRegion(self.agent, size)

    def register(self, ptr: int, size: int, device: str) -> NixlRegion:
        """Register memory the caller owns: on "cpu" or "cuda:N" (a GPU pool)."""
        self._check_open()
        region = NixlRegion(self.agent, Span.on(device, ptr, size))
        self._uses_gpu |= region.span.mem == "VRAM"
        return region

    def open(self, descriptor_bytes: bytes) -> NixlPeer:
        """A peer's region from its descriptor: ValueError if malformed, RuntimeError if
        NIXL refuses its metadata. Open a GPU peer once this process has a CUDA context
        (registering the local GPU pool gives it one): UCX picks cuda_ipc or RDMA only
        for a peer loaded then, and otherwise emulates GPU writes over TCP, far slower
        (docs/benchmarks.md, 'The `nixl` transport')."""
        self._check_open()
        agent, metadata, span = descriptor.parse(descriptor_bytes)
        if span.mem == "VRAM" and not self._uses_gpu:
            log.warning(
                "opening %s's GPU pool before registering a GPU region here: UCX may move "
                "its writes over TCP (slow); register the local pool first",
                agent,
            )
        if agent == self.agent.name:  # loopback: NIXL writes within this agent
            return NixlPeer(self, agent, span)
        remote = self._remotes.get(agent)
        # The metadata names every region the peer has registered so far: load it again
        # when it changed, or a write into a newer region is refused.
        if remote is None or remote.metadata != metadata:
            loaded = self.agent.load(metadata)
            if loaded != agent:
                if loaded not in self._remotes:
                    self.agent.forget(loaded)
                raise ValueError(f"the descriptor names agent {agent}, its metadata {loaded}")
        if remote is None:
            remote = self._remotes[agent] = _Remote(metadata)
        remote.metadata = metadata
        remote.num_peers += 1
        return NixlPeer(self, agent, span)

    def forget(self, agent: str) -> None:
        """A peer of `agent` closed: after its last one, forget the agent (disconnect)."""
        remote = self._remotes.get(agent)
        if remote is not None:
            remote.num_peers -= 1
            if remote.num_peers == 0:
                del self._remotes[agent]
                self.agent.forget(agent)

    def submit(
        self,
        src: NixlRegion,
        dst: NixlPeer,
        copies: Sequence[Copy],
        wait_stream: int | None = None,
        *,
        notify: bytes = b"",
    ) -> NixlTicket:
        """Post one WRITE of `copies` (src_offset, dst_offset, nbytes) from `src` into
        `dst`; every copy is checked first (ValueError naming it). `wait_stream`: the
        CUDA stream that wrote a GPU source, synchronized before the write is posted.
        `notify`: bytes the receiver's `notifications()` gets once the data is there."""
        self._check_open()
        if not isinstance(src, NixlRegion) or not isinstance(dst, NixlPeer):
            raise ValueError("regions of another transport")
        if src.agent is not self.agent or dst.transport is not self:
            raise ValueError("regions of another nixl transport")
        if src.closed or dst.closed:
            raise ValueError("region is closed")
        nbytes = check_copies(copies, src.size, dst.size)
        if not copies:
            return NixlTicket(self.agent, None, 0)
        if wait_stream is not None and src.span.mem == "VRAM":
            import torch

            stream = torch.cuda.ExternalStream(  # type: ignore[no-untyped-call]
                wait_stream, f"cuda:{src.span.device}"
            )
            stream.synchronize()
        handle = self.agent.post_write(src.span, dst.span, dst.agent, copies, notify)
        ticket = NixlTicket(self.agent, handle, nbytes)
        if handle is not None:
            self._tickets.add(ticket)
        return ticket

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call: (sending agent, message)."""
        self._check_open()
        return self.agent.notifications()

    def close(self) -> None:
        """Fail the writes still in flight, then deregister and disconnect everything."""
        if self.closed:
            return
        self.closed = True
        for ticket in list(self._tickets):
            if ticket.handle is not None:
                ticket.abandon("nixl write abandoned: the transport was closed")
        self._remotes.clear()
        self.agent.close()

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("transport is closed")


def check_copies(copies: Sequence[Copy], src_size: int, dst_size: int) -> int:
    """Total bytes of the copies; ValueError naming the first one out of range, or
    saying destination ranges overlap (copies of one batch may land in any order)."""
    total = 0
    for i, (src_offset, dst_offset, length) in enumerate(copies):
        if length < 1 or src_offset < 0 or dst_offset < 0:
            raise ValueError(f"copy {i}: offsets must be >= 0 and length >= 1")
        if src_offset + length > src_size or dst_offset + length > dst_size:
            raise ValueError(
                f"copy {i} ({src_offset}, {dst_offset}, {length}) is out of range of "
                f"{src_size} source and {dst_size} destination bytes"
            )
        total += length
    spans = sorted((d, d + n) for _, d, n in copies)
    if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
        raise ValueError("destination ranges overlap")
    return total
