"""ControlClient: the daemon's control API over its Unix socket, as async methods.

async with ControlClient() as ctl:       # finds the socket like lmdd does
    print((await ctl.status())["state"])
    await ctl.restart("decode-0")
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import orjson

from lmd.paths import control_socket_path, resolve_runtime_dir


class DaemonNotRunning(ConnectionError):
    """Nothing listens on the control socket."""


class ControlRequestError(RuntimeError):
    """The daemon answered with an error body."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def default_socket_path() -> Path:
    """$LMD_SOCKET, else the control socket in the default runtime directory."""
    env = os.environ.get("LMD_SOCKET")
    return Path(env) if env else control_socket_path(resolve_runtime_dir())


class ControlClient:
    def __init__(
        self, socket_path: str | os.PathLike[str] | None = None, timeout: float = 10.0
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        transport = httpx.AsyncHTTPTransport(uds=str(self.socket_path))
        # The host part is ignored on a Unix socket; "lmd" keeps logs readable.
        self._http = httpx.AsyncClient(transport=transport, base_url="http://lmd", timeout=timeout)

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        params: dict[str, str | float] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """One control request; `timeout` (seconds) replaces the client's for this one."""
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            response = await self._http.request(method, path, params=params, **extra)
        except (httpx.ConnectError, FileNotFoundError) as exc:
            raise DaemonNotRunning(
                f"lmdd is not running (no answer on {self.socket_path})"
            ) from exc
        try:
            body = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            raise ControlRequestError(
                response.status_code,
                "bad_reply",
                f"daemon answered HTTP {response.status_code} without a JSON object",
            )
        if response.is_error:
            err = body.get("error") or {}
            raise ControlRequestError(
                response.status_code,
                str(err.get("code", "error")),
                str(err.get("message", response.reason_phrase)),
            )
        return body

    async def status(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/status")

    async def workers(self) -> list[dict[str, Any]]:
        workers: list[dict[str, Any]] = (await self.request("GET", "/v1/workers"))["workers"]
        return workers

    async def restart(self, name: str) -> dict[str, Any]:
        return await self.request("POST", f"/v1/workers/{name}/restart")

    async def scale(self, role: str, count: int) -> dict[str, Any]:
        """Run `count` prefill or decode workers: {"added": [...], "retiring": [...]}."""
        return await self.request("POST", f"/v1/scale/{role}/{count}")

    async def drain(self) -> dict[str, Any]:
        return await self.request("POST", "/v1/drain")

    async def resume(self) -> dict[str, Any]:
        return await self.request("POST", "/v1/resume")

    async def shutdown(self) -> dict[str, Any]:
        return await self.request("POST", "/v1/shutdown")

    async def reload(self) -> dict[str, Any]:
        """Re-read the config: {"applied": [key], "needs_restart": [key], "changes": ...}."""
        return await self.request("POST", "/v1/reload")

    async def config(self) -> dict[str, Any]:
        """The effective config: {"file", "values", "origins", "needs_restart"}."""
        return await self.request("GET", "/v1/config")

    async def metrics(self, interval: float = 1.0) -> dict[str, Any]:
        """A summary over `interval` seconds (the reply comes after it): `api.window` and
        `api.since_start` (tok/s, req/s, TTFT/TPOT/e2e p50/p99 estimated from histogram
        buckets), `engines` (running, waiting, KV per engine worker) and `gpu`."""
        return await self.request(
            "GET", "/v1/metrics", params={"interval": interval}, timeout=interval + 15.0
        )
