"""A real lmdd started as a subprocess, for integration tests.

Runtime dirs are made with a short prefix under the temp dir: pytest's tmp_path can be
longer than a Unix socket path allows.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil

if TYPE_CHECKING:
    from tests.netns import Host

START_TIMEOUT_S = 60.0
# Model-less prefill/decode engines (the fake backend, real KV pools and migration):
# for tests of process management, with nothing heavy to load.
DISAGGREGATED = (
    "--mode",
    "disaggregated",
    "--prefill-backend",
    "fake",
    "--decode-backend",
    "fake",
    "--cache-max-entry-count",
    "64",
)


LMDCTL = [sys.executable, "-m", "lmd_client.lmdctl"]


def lmdctl(daemon: Daemon, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`lmdctl --socket <the daemon's> ARGS`, its output captured (no check)."""
    return subprocess.run(
        [*LMDCTL, "--socket", str(daemon.socket_path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def served(daemon: Daemon) -> Iterator[Daemon]:
    """A daemon fixture's body: start it, hand it to the tests, close it however they end."""
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.close()


def alive(pid: int) -> bool:
    """Is the process still running, or still closing its files? A killed process's main
    thread shows as a zombie while its other threads are still exiting, and the files
    they share (a listening socket) close only with the last of them."""
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE or process.num_threads() > 1
    except psutil.NoSuchProcess:
        return False


class Daemon:
    def __init__(
        self,
        *extra: str,
        runtime_dir: Path | None = None,
        port: int | None = None,
        host: Host | None = None,
    ) -> None:
        """`host`: run inside that network namespace (tests/netns.py), the API on its
        address."""
        self.runtime_dir = runtime_dir or Path(tempfile.mkdtemp(prefix="lmdt-"))
        self.host = host
        self.port = port or (23333 if host else free_port())  # a namespace has its own ports
        self.log_path = self.runtime_dir.parent / f"{self.runtime_dir.name}.log"
        self.args = [
            sys.executable,
            "-m",
            "lmd",
            "serve",
            "--runtime-dir",
            str(self.runtime_dir),
            "--port",
            str(self.port),
            *(("--host", host.address) if host else ()),
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self._http: httpx.Client | None = None

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / "control.sock"

    @property
    def url(self) -> str:
        return f"http://{self.host.address if self.host else '127.0.0.1'}:{self.port}"

    def start(self, wait: bool = True) -> Daemon:
        with open(self.log_path, "ab") as log:
            if self.host is not None:
                self.proc = self.host.popen(self.args, stdout=log, stderr=subprocess.STDOUT)
            else:
                self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_state("running", START_TIMEOUT_S)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def control(self) -> httpx.Client:
        if self._http is None:
            transport = httpx.HTTPTransport(uds=str(self.socket_path))
            self._http = httpx.Client(transport=transport, base_url="http://lmd", timeout=5)
        return self._http

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = self.control().get("/v1/status").json()
        return body

    def try_status(self) -> dict[str, Any] | None:
        try:
            return self.status()
        except (httpx.HTTPError, OSError, ValueError):
            return None

    def wait_state(self, state: str, timeout: float) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"lmdd exited with {self.proc.returncode}:\n{self.log()}")
            s = self.try_status()
            return s if s and s["state"] == state else None

        status: dict[str, Any] = wait_until(check, timeout, f"daemon state {state}")
        return status

    def worker(self, name: str) -> dict[str, Any]:
        return next(w for w in self.status()["workers"] if w["name"] == name)

    def child_pids(self) -> list[int]:
        if self.proc is None:
            return []
        with contextlib.suppress(psutil.NoSuchProcess):
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        return []

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Stop whatever is left, however the test ended."""
        if self._http is not None:
            self._http.close()
        pids = self.child_pids()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
