"""Uvicorn embedded in a process that already runs an asyncio loop (api, control).

We bind the listening socket ourselves: a port in use becomes a clear one-line error
instead of uvicorn's sys.exit, and the control socket gets its mode (0660) before
anyone can connect. The process owns its signals, so uvicorn must not install handlers.

On a Unix socket (the control API) each connection's peer, as the kernel saw it connect
(SO_PEERCRED: pid, uid, gid), is logged at debug level and handed to the app in every
request's `scope["state"]["peer"]`; bytes that are not HTTP at all are answered with the
control API's structured error, not uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette import responses
from starlette.types import Message, Receive

log = logging.getLogger(__name__)


class JSONResponse(responses.JSONResponse):
    """orjson-encoded JSON (FastAPI deprecated its own ORJSONResponse).

    A JSONResponse, so FastAPI documents routes answering it as JSON, not as a string.
    """

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class BindError(OSError):
    """The listening socket could not be created; the message says where and why."""


def bind_tcp(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(False)
    return sock


def bind_unix(path: Path, mode: int) -> socket.socket:
    """Listen on a Unix socket with `mode`, set before listen() so no one races it."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, mode)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {path}: {exc.strerror}") from None
    return sock


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end of a Unix socket connection, when it connected."""

    pid: int
    uid: int
    gid: int


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_of(sock: Any) -> Peer | None:
    """SO_PEERCRED of a connected Unix socket; None where there is none (not Linux, no peer)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (AttributeError, OSError):
        return None
    peer = Peer(*_UCRED.unpack(raw))
    return None if peer.uid == -1 else peer  # the kernel's "nobody there": (0, -1, -1)


def _unix_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, knowing each connection's peer and answering junk in JSON."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class UnixProtocol(base):  # type: ignore[misc]
        app_state: dict[str, Any]  # uvicorn's

        def connection_made(self, transport: asyncio.Transport) -> None:
            peer = peer_of(transport.get_extra_info("socket"))
            if peer is not None:
                where = transport.get_extra_info("sockname")
                log.debug("%s: connection from pid %d uid %d gid %d", where, *astuple(peer))
            # uvicorn copies app_state into each request's scope["state"]: one per connection
            self.app_state = {**self.app_state, "peer": peer}
            super().connection_made(transport)

        def send_400_response(self, msg: str) -> None:
            body = orjson.dumps({"error": {"code": "bad_request", "message": msg}})
            head = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            self.transport.write(head + body)
            self.transport.close()

    return UnixProtocol


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the worker/supervisor handles SIGTERM/SIGINT itself


class EmbeddedServer:
    """Serve an ASGI app on a pre-bound socket inside the running loop."""

    def __init__(self, app: Any, sock: socket.socket, log_level: str) -> None:
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            log_level=log_level,
            timeout_graceful_shutdown=5,
            http=_unix_protocol() if sock.family == socket.AF_UNIX else "auto",
        )
        self._server = _Server(config)
        self._sock = sock
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raise why it could not start
                raise RuntimeError("http server exited during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._sock.close()


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the body read already, then the connection's own events."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
