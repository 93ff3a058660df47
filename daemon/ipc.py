"""Typed ZeroMQ channels and the naming of every internal endpoint.

Endpoints are `ipc://` files in the runtime directory (see paths.py), so two daemons
with different runtime directories never collide and no TCP port is used inside.

Links:
  supervisor  ROUTER (bind)  <->  DEALER (connect, identity = worker name)  each worker
  worker inbox PULL (bind)   <-   PUSH from whoever feeds that worker (the data path)

A channel decodes with protocol.decode; a frame set that does not decode is logged
(rate-limited), counted in `num_dropped` and skipped: a peer can never crash us.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class Endpoints:
    runtime_dir: Path

    @property
    def supervisor(self) -> str:
        return f"ipc://{self.runtime_dir}/supervisor.ipc"

    def inbox(self, worker_name: str) -> str:
        return f"ipc://{self.runtime_dir}/{worker_name}.ipc"

    def ipc_files(self) -> list[Path]:
        """Every socket file a daemon may leave behind (for stale cleanup)."""
        return sorted(self.runtime_dir.glob("*.ipc"))


class _Dropping:
    """Counts and logs what does not decode."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.num_dropped = 0

    def _drop(self, reason: str) -> None:
        self.num_dropped += 1
        n = self.num_dropped
        if n <= _LOG_FIRST_DROPS or n % _LOG_EVERY_DROPS == 0:
            log.warning("%s: dropped malformed message #%d: %s", self.label, n, reason)


class Channel(_Dropping):
    """One socket that sends and receives whole protocol messages (PUSH/PULL/DEALER)."""

    def __init__(self, socket: zmq.asyncio.Socket, label: str) -> None:
        super().__init__(label)
        self.socket = socket
        # The asyncio socket reports a full queue in a returned future, never as
        # zmq.Again; a plain socket over the same handle raises it (and costs less).
        self._nowait: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)

    async def send(self, msg: Message) -> None:
        await self.socket.send_multipart(protocol.encode(msg), copy=False)

    def try_send(self, msg: Message) -> bool:
        """Send without waiting; False when the peer is gone or not keeping up (queue full)."""
        try:
            self._nowait.send_multipart(protocol.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    async def recv(self) -> Message:
        while True:
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
        self.socket = socket

    async def send(self, identity: str, msg: Message) -> None:
        frames = [identity.encode(), *protocol.encode(msg)]
        await self.socket.send_multipart(frames, copy=False)

    async def recv(self) -> tuple[str, Message]:
        while True:
            identity, *frames = await self.socket.recv_multipart()
            try:
                return identity.decode("utf-8", "replace"), protocol.decode(frames)
            except ProtocolError as exc:
                self._drop(str(exc))

    def close(self) -> None:
        self.socket.close(linger=0)


def bind_router(ctx: zmq.asyncio.Context, endpoint: str, label: str) -> RouterChannel:
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    return RouterChannel(sock, label)


def connect_dealer(ctx: zmq.asyncio.Context, endpoint: str, identity: str) -> Channel:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(endpoint)
    return Channel(sock, f"{identity}<-supervisor")


def bind_pull(ctx: zmq.asyncio.Context, endpoint: str, label: str) -> Channel:
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    return Channel(sock, label)


def connect_push(ctx: zmq.asyncio.Context, endpoint: str, label: str) -> Channel:
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    return Channel(sock, label)
