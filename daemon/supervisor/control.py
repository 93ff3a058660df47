"""The control API: JSON over HTTP on $RUNTIME_DIR/control.sock (mode 0660).

    curl --unix-socket /run/lmd/control.sock http://lmd/v1/status

Each route's docstring is its help text and its protocol. Errors are
`{"error": {"code": str, "message": str}}` with a 4xx status, never a traceback.

Who may use it: the socket's mode (0660, in a 0750 directory) keeps other users out of
connecting at all; past that, `_Guard` refuses (403 `forbidden`, and a warning naming the
pid and uid) a peer whose uid is neither root nor the daemon's own, e.g. one in the
socket's group. It also refuses junk before any route runs: a body that is not a JSON
object (400 `bad_json`) or is larger than any command needs (413 `body_too_large`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from lmd import __version__
from lmd.http_server import JSONResponse, Peer, replay
from lmd.protocol import Role
from lmd.supervisor.errors import (
    BadArgument,
    BadConfig,
    SupervisorError,
    UnknownWorker,
    WrongState,
)
from lmd.supervisor.metrics_collect import MAX_INTERVAL_S, collect, scrape_url
from lmd.supervisor.states import WorkerState

if TYPE_CHECKING:
    from lmd.supervisor.supervisor import Supervisor

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024  # no command takes a body; a client may send `{}`


def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}
# The one place a supervisor's refusal becomes an HTTP status.
_STATUS: dict[type[SupervisorError], int] = {
    UnknownWorker: 404,
    WrongState: 409,
    BadArgument: 400,
    BadConfig: 400,
}


def validation_message(errors: Sequence[Any]) -> str:
    """FastAPI's validation errors as one line: `count: Input should be a valid integer`."""
    parts = []
    for error in errors:
        where = str(error.get("loc", ("?",))[-1])
        value = f" (got {error['input']!r})" if isinstance(error.get("input"), str) else ""
        parts.append(f"{where}: {error.get('msg', 'invalid')}{value}")
    return "; ".join(parts) or "invalid request"


def peer_allowed(uid: int, own_uid: int | None = None) -> bool:
    """Root and the daemon's own user may use the control API; nobody else."""
    return uid in (0, os.getuid() if own_uid is None else own_uid)


class _Guard:
    """Refuses other users' peers and junk bodies before any route runs (pure ASGI)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await _read_body(receive)
        except _ClientGone:
            return  # nobody to answer
        refused = self._refuse_peer(scope.get("state", {}).get("peer")) or _refuse_body(body)
        if refused is not None:
            await refused(scope, receive, send)
        else:
            assert body is not None
            await self.app(scope, replay(body, receive), send)

    @staticmethod
    def _refuse_peer(peer: Peer | None) -> JSONResponse | None:
        if peer is None or peer_allowed(peer.uid):
            return None  # no credentials (not Linux): the socket's mode is the guard
        own = os.getuid()
        allowed = "root" if own == 0 else f"root and uid {own}"
        log.warning(
            "control socket: refused pid %d uid %d gid %d (only %s may use it)",
            peer.pid,
            peer.uid,
            peer.gid,
            allowed,
        )
        message = f"uid {peer.uid} may not use this daemon's control socket (only {allowed})"
        return error_response(403, "forbidden", message)


class _ClientGone(Exception):
    """The client hung up before its request body was complete."""


async def _read_body(receive: Receive) -> bytes | None:
    """The whole body, or None once it passes MAX_BODY_BYTES; raises _ClientGone."""
    parts, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        part = message.get("body", b"")
        size += len(part)
        if size > MAX_BODY_BYTES:
            return None
        parts.append(part)
        more = message.get("more_body", False)
    return b"".join(parts)


def _refuse_body(body: bytes | None) -> JSONResponse | None:
    """Junk: too large (None), not JSON, or JSON but not an object; an empty body is fine."""
    if body is None:
        return error_response(413, "body_too_large", f"request body is over {MAX_BODY_BYTES} bytes")
    if not body.strip():
        return None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return error_response(400, "bad_json", f"request body is not valid JSON: {exc}")
    if not isinstance(parsed, dict):
        return error_response(400, "bad_json", "request body must be a JSON object")
    return None


def build_control_app(sup: Supervisor) -> FastAPI:
    app = FastAPI(
        title="lmd control",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        default_response_class=JSONResponse,
    )
    app.add_middleware(_Guard)

    @app.exception_handler(SupervisorError)
    async def refused(_: Request, exc: SupervisorError) -> JSONResponse:
        return error_response(_STATUS[type(exc)], exc.code, exc.message)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "error")
        response = error_response(exc.status_code, code, str(exc.detail))
        response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110)
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, "bad_request", validation_message(exc.errors()))

    @app.exception_handler(Exception)
    async def failed(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input (that is a SupervisorError): still one structured line
        # for lmdctl; Starlette logs the traceback after this answer.
        first = next(iter(str(exc).splitlines()), "")
        message = f"internal error: {type(exc).__name__}: {first} (the daemon's log has more)"
        return error_response(500, "internal_error", message)

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        """The daemon's state, model, uptime and every worker (see `/v1/workers`)."""
        return sup.status()

    @app.get("/v1/workers")
    async def workers() -> dict[str, Any]:
        """Every worker: name, role, pid, state, backend, device, restarts, rss_bytes."""
        return {"workers": sup.workers()}

    @app.post("/v1/workers/{name}/restart")
    async def restart(name: str) -> dict[str, Any]:
        """Stop worker NAME (SIGTERM) and start it again at once; 404 for an unknown name."""
        sup.restart_worker(name)
        return {"ok": True, "worker": name}

    @app.post("/v1/scale/{role}/{count}")
    async def scale(role: str, count: int) -> dict[str, Any]:
        """Run COUNT workers of ROLE (prefill or decode; disaggregated mode): new ones
        start at once; removed ones (the highest indices) take no new request and stop
        once idle (`retiring` in status). Answers {role, count, added, retiring}."""
        return await sup.scale(role, count)

    @app.post("/v1/drain")
    async def drain() -> dict[str, Any]:
        """Refuse new requests, finish those in flight, keep running (undo: resume)."""
        await sup.drain()
        return {"ok": True, "state": str(sup.state)}

    @app.post("/v1/resume")
    async def resume() -> dict[str, Any]:
        """Admit requests again after a drain; 409 unless draining."""
        await sup.resume()
        return {"ok": True, "state": str(sup.state)}

    @app.get("/v1/config")
    async def config() -> dict[str, Any]:
        """The running config by key (`values`), where each came from (`origins`: default,
        command line, env LMD_X, file PATH), the `file` read, and `needs_restart`: values
        a reload loaded that only a restart applies."""
        return sup.loaded.to_json()

    @app.post("/v1/reload")
    async def reload() -> dict[str, Any]:
        """Read the config file and LMD_* environment again (flags stay). Answers which
        changed keys were `applied` live (log_level) and which `needs_restart`, with
        `changes` {key: {from, to}}; a bad file is 400 `bad_config`, the daemon unchanged."""
        return await sup.reload()

    @app.get("/v1/metrics")
    async def metrics(interval: float = 1.0) -> dict[str, Any]:
        """A summary over a window of `interval` seconds (default 1, at most 60): the api's
        tok/s and req/s, TTFT/TPOT/e2e count, mean, p50 and p99 (estimated from the
        /metrics histogram buckets) over the window and since the daemon started; running,
        waiting and KV use per engine worker (heartbeats); GPU memory and utilisation
        (NVML; `gpu.reason` says why it is absent). Answers after the window."""
        if not 0 < interval <= MAX_INTERVAL_S:
            raise BadArgument("bad_interval", f"interval must be > 0 and <= {MAX_INTERVAL_S:.0f} s")
        url = scrape_url(sup.config.host, sup.config.port)
        apis = {
            c.name: url
            for c in sup.children.values()
            if c.role == Role.API and c.state == WorkerState.RUNNING
        }
        reply = await collect(apis, sup.workers, interval)
        return {"state": str(sup.state), "model": sup.config.served_model_name, **reply}

    @app.post("/v1/shutdown")
    async def shutdown() -> dict[str, Any]:
        """Drain (up to drain_timeout), stop every worker and exit 0, as SIGTERM does."""
        sup.request_stop("shutdown requested over the control socket")
        return {"ok": True, "state": str(sup.state)}

    return app
