"""Typed ZeroMQ channels and the naming of every internal endpoint.

Endpoints are `ipc://` files in the runtime directory (see paths.py), so two daemons
with different runtime directories never collide and no TCP port is used inside.

Links:
  supervisor  ROUTER (bind)  <->  DEALER (connect, identity = worker name)  each worker
  worker inbox PULL (bind)   <-   PUSH from whoever feeds that worker (the data path)

A channel decodes with protocol.decode; a frame set that does not decode is logged
(rate-limited), counted in `num_dropped` and skipped: a peer can never crash us. Nor
can it starve the event loop: a receive that finds a message waiting returns without
yielding, so every RECV_BATCH receives a channel yields once (a flood of 500k messages
would otherwise hold heartbeats and HTTP for seconds). No frame over
protocol.MAX_FRAME_BYTES is taken in (ZMQ_MAXMSGSIZE: libzmq drops the peer's
connection instead), and no message over its kind's cap is sent (kinds.MAX_BYTES).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from lmd import protocol
from lmd.protocol import Message, ProtocolError

log = logging.getLogger(__name__)

_LOG_FIRST_DROPS = 10
_LOG_EVERY_DROPS = 1000
RECV_BATCH = 64  # messages a channel takes in before it lets the event loop run


def should_log(n: int) -> bool:
    """Log the n-th of a kind of event that peers can repeat: the first 10, then every 1000th."""
    return n <= _LOG_FIRST_DROPS or n % _LOG_EVERY_DROPS == 0


def _capped(socket: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
    """Before it binds or connects (libzmq copies options into each listener then)."""
    socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
    return socket


@dataclass(frozen=True, slots=True)
class Endpoints:
    runtime_dir: Path

    @property
    def supervisor(self) -> str:
        return f"ipc://{self.runtime_dir}/supervisor.ipc"

    def inbox(self, worker_name: str) -> str:
        return f"ipc://{self.runtime_dir}/{worker_name}.ipc"

    def rank_ops(self, worker_name: str, rank: int) -> str:
        """Where a tensor-parallel group's rank `rank` takes its ops (rank 0 binds it)."""
        return f"ipc://{self.runtime_dir}/{worker_name}.r{rank}.ipc"

    def rank_replies(self, worker_name: str) -> str:
        """Where the ranks of `worker_name`'s group answer (rank 0 binds it)."""
        return f"ipc://{self.runtime_dir}/{worker_name}.ranks.ipc"

    def rendezvous(self, worker_name: str) -> Path:
        """The file a tensor-parallel group meets at (torch.distributed's file store)."""
        return self.runtime_dir / f"{worker_name}.tp"

    def ipc_files(self) -> list[Path]:
        """Every socket file a daemon may leave behind (for stale cleanup)."""
        return sorted(self.runtime_dir.glob("*.ipc"))


class _Dropping:
    """Counts and logs what does not decode; paces receiving (RECV_BATCH)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.num_dropped = 0
        self._num_since_yield = 0

    def _drop(self, reason: str) -> None:
        self.num_dropped += 1
        n = self.num_dropped
        if should_log(n):
            log.warning("%s: dropped malformed message #%d: %s", self.label, n, reason)

    async def _pace(self) -> None:
        self._num_since_yield += 1
        if self._num_since_yield >= RECV_BATCH:
            self._num_since_yield = 0
            await asyncio.sleep(0)


class Channel(_Dropping):
    """One socket that sends and receives whole protocol messages (PUSH/PULL/DEALER)."""

    def __init__(self, socket: zmq.asyncio.Socket, label: str) -> None:
        super().__init__(label)
        self.socket = _capped(socket)
        self.num_oversize = 0  # messages not sent: over their kind's cap
        # The asyncio socket reports a full queue in a returned future, never as
        # zmq.Again; a plain socket over the same handle raises it (and costs less).
        self._nowait: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)

    async def send(self, msg: Message) -> None:
        await self.socket.send_multipart(protocol.encode(msg), copy=False)

    def try_send(self, msg: Message) -> bool:
        """Send without waiting; False when the peer is gone or not keeping up (queue full),
        or the message is over its kind's cap (the peer would drop it)."""
        frames = self.encode(msg)
        return frames is not None and self.try_send_frames(frames)

    def encode(self, msg: Message) -> list[bytes] | None:
        """`msg`'s frames; None (logged, counted in num_oversize) when over its kind's cap."""
        frames = protocol.encode(msg)
        if why := protocol.oversize(frames):
            self.num_oversize += 1
            if should_log(self.num_oversize):
                log.error("%s: not sent: %s", self.label, why)
            return None
        return frames

    def try_send_frames(self, frames: list[bytes]) -> bool:
        """Hand encoded frames to ZeroMQ without waiting; False when its queue is full."""
        try:
            self._nowait.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    async def recv(self) -> Message:
        while True:
            await self._pace()
            frames = await self.socket.recv_multipart()
            try:
                return protocol.decode(frames)
            except ProtocolError as exc:
                self._drop(str(exc))

    def close(self) -> None:
        self.socket.close(linger=0)


class RouterChannel(_Dropping):
    """A ROUTER socket: every message carries the peer's identity (its worker name)."""

    def __init__(self, socket: zmq.asyncio.Socket, label: str) -> None:
        super().__init__(label)
        self.socket = _capped(socket)

    async def send(self, identity: str, msg: Message) -> None:
        frames = [identity.encode(), *protocol.encode(msg)]
        await self.socket.send_multipart(frames, copy=False)

    async def recv(self) -> tuple[str, Message]:
        while True:
            await self._pace()
            identity, *frames = await self.socket.recv_multipart()
            try:
                return identity.decode("utf-8", "replace"), protocol.decode(frames)
            except ProtocolError as exc:
                self._drop(str(exc))

    def close(self) -> None:
        self.socket.close(linger=0)


def bind_router(ctx: zmq.asyncio.Context, endpoint: str, label: str) -> RouterChannel:
    channel = RouterChannel(ctx.socket(zmq.ROUTER), label)
    channel.socket.bind(endpoint)
    return channel


def connect_dealer(ctx: zmq.asyncio.Context, endpoint: str, identity: str) -> Channel:
    channel = Channel(ctx.socket(zmq.DEALER), f"{identity}<-supervisor")
    channel.socket.setsockopt(zmq.IDENTITY, identity.encode())
    channel.socket.connect(endpoint)
    return channel


def bind_pull(ctx: zmq.asyncio.Context, endpoint: str, label: str) -> Channel:
    channel = Channel(ctx.socket(zmq.PULL), label)
    channel.socket.bind(endpoint)
    return channel


def connect_push(ctx: zmq.asyncio.Context, endpoint: str, label: str) -> Channel:
    channel = Channel(ctx.socket(zmq.PUSH), label)
    channel.socket.connect(endpoint)
    return channel
