"""Uvicorn embedded in a process that already runs an asyncio loop (api, control).

We bind the listening socket ourselves: a port in use becomes a clear one-line error
instead of uvicorn's sys.exit, and the control socket gets its mode (0660) before
anyone can connect. The process owns its signals, so uvicorn must not install handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette.responses import Response


class JSONResponse(Response):
    """orjson-encoded JSON (FastAPI deprecated its own ORJSONResponse)."""

    media_type = "application/json"

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
