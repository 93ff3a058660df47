"""Uvicorn embedded in a process that already runs an asyncio loop (api, control).

We bind the listening socket ourselves: a port in use becomes a clear one-line error
instead of uvicorn's sys.exit, and the control socket gets its mode (0660) before
anyone can connect. The process owns its signals, so uvicorn must not install handlers.
Connections are accepted by our own loop (http_listener.py: a cap on open connections, a
503 past it, no harm from running out of descriptors) and served by uvicorn's h11
protocol with a header timeout and half-close support (http_protocol.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette import responses
from starlette.types import Message, Receive

from lmd.http_listener import Listener, default_max_connections, http_response
from lmd.http_protocol import Connection, Peer, UnixConnection, peer_of

__all__ = ["Peer", "peer_of"]  # kept here for the control API, which names them so

HEADER_TIMEOUT_S = 10.0
# Seconds an idle kept-alive connection stays open: longer than clients keep idle pooled
# connections (httpx, so the OpenAI SDK and lmd-bench: 5 s; aiohttp: 15 s; nginx upstream
# pools and cloud load balancers: 60 s), so that the client, not the server, closes it. A
# server that closes first races the request a client may be sending on it; uvicorn's
# default of 5 s was httpx's 5 s. 75 s is nginx's own keepalive_timeout.
KEEP_ALIVE_S = 75.0
SOMAXCONN_PATH = Path("/proc/sys/net/core/somaxconn")


class JSONResponse(responses.JSONResponse):
    """orjson-encoded JSON (FastAPI deprecated its own ORJSONResponse).

    A JSONResponse, so FastAPI documents routes answering it as JSON, not as a string.
    """

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def quiet_http_client_logs() -> None:
    """httpx logs every request at INFO (a line per /metrics scrape, as the api reads the
    supervisor's status) and httpcore each step at DEBUG: keep both to warnings."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


class BindError(OSError):
    """The listening socket could not be created; the message says where and why."""


def listen_backlog() -> int:
    """The most connections the kernel lets wait for accept (net.core.somaxconn, which
    caps any listen() backlog). A burst of new connections larger than the backlog has
    some SYNs dropped, each costing its client 1-3 s of retransmission: lmd-bench opens a
    connection per streamed request, 512 at once at concurrency 512."""
    try:
        return int(SOMAXCONN_PATH.read_text())
    except (OSError, ValueError):
        return socket.SOMAXCONN


def bind_tcp(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """Listen on host:port. `reuse_port`: with SO_REUSEPORT, so that several processes
    listen on the port and the kernel spreads new connections over them (by a hash of
    the client's address and port)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(listen_backlog())
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


_TOO_MANY = orjson.dumps(
    {"error": {"code": "too_many_connections", "message": "too many connections; retry later"}}
)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What a server allows each connection, and how it refuses one past the cap."""

    max_connections: int | None = None  # None: what RLIMIT_NOFILE leaves room for
    header_timeout_s: float = HEADER_TIMEOUT_S
    refusal: bytes = http_response(503, _TOO_MANY, {"Retry-After": "1"})
    keep_alive_s: float = KEEP_ALIVE_S  # an idle connection's life between requests


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, limits: ConnectionLimits) -> None:
        super().__init__(config)
        self.limits = limits

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the worker/supervisor handles SIGTERM/SIGINT itself

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, with our Listener in place of loop.create_server."""
        assert sockets is not None and len(sockets) == 1
        await self.lifespan.startup()
        sock, limits, state = sockets[0], self.limits, self.server_state
        kind = UnixConnection if sock.family == socket.AF_UNIX else Connection

        timeouts = (limits.header_timeout_s, limits.keep_alive_s)

        def connection() -> asyncio.Protocol:
            return kind(self.config, state, self.lifespan.state, *timeouts)

        listener = Listener(
            sock,
            connection,
            max_connections=limits.max_connections or default_max_connections(),
            num_open=lambda: len(state.connections),
            refusal=limits.refusal,
        )
        self.servers = [listener]  # type: ignore[list-item]  # uvicorn closes and awaits it
        self.started = True


class EmbeddedServer:
    """Serve an ASGI app on a pre-bound socket inside the running loop."""

    def __init__(
        self,
        app: Any,
        sock: socket.socket,
        log_level: str,
        limits: ConnectionLimits | None = None,
    ) -> None:
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            log_level=log_level,
            timeout_graceful_shutdown=5,
            http="h11",  # the protocol http_protocol.py extends
        )
        self._server = _Server(config, limits or ConnectionLimits())
        self._sock = sock
        self._task: asyncio.Task[None] | None = None

    @property
    def task(self) -> asyncio.Task[None]:
        """The task serving (after start): it ends only when the server stops or fails."""
        assert self._task is not None
        return self._task

    @property
    def listener(self) -> Listener:
        listener = self._server.servers[0]
        assert isinstance(listener, Listener)
        return listener

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
