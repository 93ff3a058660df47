"""HTTP plumbing of the api: the request guard, SSE responses, error bodies (docs: docs.py),
and its connection limits (http_server.ConnectionLimits, the 503 past the cap).

`RequestGuard` is plain ASGI middleware (no per-request task, unlike BaseHTTPMiddleware):
it checks the Bearer key on /v1/*, /tokenize and /detokenize (constant-time; /health,
/metrics and the docs stay open, as in vLLM) and reads at most `max_body_bytes` of a body
before anything parses it, answering 401 and 413 as OpenAI error bodies.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncGenerator, Callable, Sequence

import orjson
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from lmd.api.openai_schema import ApiError
from lmd.config import ServeConfig
from lmd.http_listener import http_response
from lmd.http_server import ConnectionLimits, JSONResponse, replay

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})  # beside /v1/*: they take work


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body, status_code=err.status, headers=err.headers)


def connection_limits(config: ServeConfig) -> ConnectionLimits:
    """The api's connection cap and header timeout; past the cap, an OpenAI 503."""
    message = "the server holds as many connections as it can; retry later"
    err = ApiError(503, message, type="overloaded", code="too_many_connections", retry_after_s=1)
    refusal = http_response(err.status, orjson.dumps(err.body), err.headers)
    return ConnectionLimits(
        max_connections=config.max_connections,
        header_timeout_s=config.header_timeout,
        refusal=refusal,
    )


def install_error_handlers(app: FastAPI) -> None:
    """An ApiError a route raises, unknown routes, wrong methods and unexpected exceptions
    answer OpenAI bodies."""

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = error_response(ApiError(exc.status_code, str(exc.detail), type=kind))
        response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110)
        return response

    async def internal_error(request: Request, exc: Exception) -> Response:
        message = f"internal error: {type(exc).__name__}: {exc}"
        return error_response(ApiError(500, message, type="internal_error"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)


async def disconnected(request: Request) -> None:
    """Return once the client has gone (call after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A streamed response (SSE by default) whose `on_close` runs however it ends.

    `client_gone` completes when the client goes away (`disconnected`, started by the
    route before the stream); the stream is then cancelled, its generator closed and
    `on_close` called right then.
    """

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        on_close: Callable[[], None],
        client_gone: asyncio.Future[None],
        media_type: str = "text/event-stream",
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(chunks, media_type=media_type, headers=headers)
        self._chunks = chunks
        self._on_close = on_close
        self._client_gone = client_gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette runs the stream and a disconnect listener in an anyio task group per
        # response when the server speaks ASGI < 2.4, as uvicorn does: most of the CPU of a
        # one-chunk response (docs/benchmarks.md, 'Last runs of this session'); here the
        # route's own watcher cancels this task when the client goes.
        task = asyncio.current_task()
        assert task is not None
        streaming, gone = True, False

        def on_gone(watcher: asyncio.Future[None]) -> None:
            nonlocal gone
            if streaming and not watcher.cancelled():
                gone = True
                task.cancel()

        self._client_gone.add_done_callback(on_gone)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:
                raise  # cancelled from elsewhere too (shutdown): let it through
        finally:
            streaming = False
            self._client_gone.remove_done_callback(on_gone)
            self._client_gone.cancel()
            try:
                await self._chunks.aclose()
            finally:
                self._on_close()


class _ClientGone(Exception):
    """The client hung up before its request body was complete."""


class GuardLimits:
    """What RequestGuard enforces; `lmdctl reload` changes it in place (live keys)."""

    def __init__(self, api_keys: Sequence[str], max_body_bytes: int) -> None:
        self.set(api_keys, max_body_bytes)

    def set(self, api_keys: Sequence[str], max_body_bytes: int) -> None:
        self.keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        limits: GuardLimits,
        on_reject: Callable[[str, int], None],
    ) -> None:
        self.app = app
        self.limits = limits
        self.on_reject = on_reject  # (path, status) of each request refused here

    @property
    def keys(self) -> list[bytes]:
        return self.limits.keys

    @property
    def max_body_bytes(self) -> int:
        return self.limits.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.keys and (path.startswith("/v1/") or path in _KEYED_PATHS):
            err = self._check_key(headers.get(b"authorization", b""))
            if err is not None:
                await self._reject(scope, receive, send, err)
                return
        if scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self._reject(scope, receive, send, self._too_large())
            return
        content_type = headers.get(b"content-type")
        if content_type is not None and not _is_json(content_type):
            # Not JSON by its own account. Refusing it also keeps browsers' "simple"
            # cross-site POSTs (form or text/plain, sent without a CORS preflight) out.
            await self._reject(scope, receive, send, _not_json(content_type))
            return
        try:
            body = await self._read_body(receive)
        except _ClientGone:
            return  # nobody to answer
        if body is None:  # over the limit while it streamed in (no Content-Length)
            await self._reject(scope, receive, send, self._too_large())
            return
        await self.app(scope, replay(body, receive), send)

    def _check_key(self, authorization: bytes) -> ApiError | None:
        scheme, _, given = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            message = "missing API key: send it as 'Authorization: Bearer KEY'"
            return ApiError(401, message, code="invalid_api_key")
        given = given.strip()
        ok = False
        for key in self.keys:  # no early exit: the time does not depend on which matched
            ok |= hmac.compare_digest(given, key)
        return None if ok else ApiError(401, "incorrect API key", code="invalid_api_key")

    def _too_large(self) -> ApiError:
        message = f"the request body is larger than the limit of {self.max_body_bytes} bytes"
        return ApiError(413, message, code="request_too_large")

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit; raises _ClientGone."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_body_bytes:
                return None
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, err: ApiError) -> None:
        self.on_reject(scope["path"], err.status)
        headers = err.headers
        if err.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        await JSONResponse(err.body, status_code=err.status, headers=headers)(scope, receive, send)


def _is_json(content_type: bytes) -> bool:
    """application/json or application/*+json, whatever the parameters (charset)."""
    media = content_type.partition(b";")[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


def _not_json(content_type: bytes) -> ApiError:
    given = content_type.decode("latin-1")
    message = f"the request body must be JSON (Content-Type: application/json), got {given!r}"
    return ApiError(415, message, code="unsupported_media_type")
