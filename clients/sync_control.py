"""SyncControlClient: ControlClient without await, for scripts.

    with SyncControlClient() as ctl:        # finds the socket like lmdd does
        print(ctl.status()["state"])
        ctl.restart("decode-0")

The same methods, arguments and errors (DaemonNotRunning, ControlRequestError) as
ControlClient; it runs its own event loop (sync_loop.py), so inside a running asyncio
loop use ControlClient.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lmd_client.control import ControlClient
from lmd_client.sync_loop import SyncLoop


class SyncControlClient(SyncLoop[ControlClient]):
    def __init__(
        self, socket_path: str | os.PathLike[str] | None = None, timeout: float = 10.0
    ) -> None:
        super().__init__(ControlClient(socket_path, timeout))

    @property
    def socket_path(self) -> Path:
        return self._client.socket_path

    def request(
        self,
        method: str,
        path: str,
        params: dict[str, str | float] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """One control request; `timeout` (seconds) replaces the client's for this one."""
        return self._run(self._client.request(method, path, params, timeout))

    def status(self) -> dict[str, Any]:
        return self._run(self._client.status())

    def workers(self) -> list[dict[str, Any]]:
        return self._run(self._client.workers())

    def restart(self, name: str) -> dict[str, Any]:
        return self._run(self._client.restart(name))

    def scale(self, role: str, count: int) -> dict[str, Any]:
        """Run `count` prefill or decode workers: {"added": [...], "retiring": [...]}."""
        return self._run(self._client.scale(role, count))

    def drain(self) -> dict[str, Any]:
        return self._run(self._client.drain())

    def resume(self) -> dict[str, Any]:
        return self._run(self._client.resume())

    def shutdown(self) -> dict[str, Any]:
        return self._run(self._client.shutdown())

    def reload(self) -> dict[str, Any]:
        """Re-read the config: {"applied": [key], "needs_restart": [key], "changes": ...}."""
        return self._run(self._client.reload())

    def config(self) -> dict[str, Any]:
        """The effective config: {"file", "values", "origins", "needs_restart"}."""
        return self._run(self._client.config())

    def metrics(self, interval: float = 1.0) -> dict[str, Any]:
        """A summary over `interval` seconds (the reply comes after it); see ControlClient."""
        return self._run(self._client.metrics(interval))
