"""sd_notify from a real daemon to a datagram socket bound here, as systemd's would be.

The daemon runs with NOTIFY_SOCKET pointing at the socket and WATCHDOG_USEC=1000000, so
WATCHDOG=1 is due every 0.5 s.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.integration.daemon import DISAGGREGATED, START_TIMEOUT_S, Daemon, wait_until

WORKERS = 4
LMDCTL = [sys.executable, "-m", "lmd_client.lmdctl"]
# Bare tokenizer/prefill/decode/api workers: fast to start, no model loaded.


class NotifyListener:
    """Collects every datagram with its arrival time (monotonic) on a background thread.

    When READY=1 arrives, the thread at once tries the daemon's HTTP port, so the test
    can tell whether the port already listened at that moment.
    """

    def __init__(self, http_port: int) -> None:
        self.folder = tempfile.mkdtemp(prefix="lmdn-")  # short: sun_path holds 108 bytes
        self.path = os.path.join(self.folder, "notify")
        self.http_port = http_port
        self.messages: list[tuple[float, list[str]]] = []
        self.port_open_at_ready: list[bool] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.settimeout(0.2)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._done.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            fields = data.decode().split("\n")
            if "READY=1" in fields:
                self.port_open_at_ready.append(self._port_open())
            self.messages.append((time.monotonic(), fields))

    def _port_open(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.http_port), timeout=1).close()
        except OSError:
            return False
        return True

    def times(self, field: str, after: float = 0.0) -> list[float]:
        return [t for t, fields in list(self.messages) if field in fields and t > after]

    def statuses(self, after: float = 0.0) -> list[str]:
        return [
            f.removeprefix("STATUS=")
            for t, fields in list(self.messages)
            for f in fields
            if f.startswith("STATUS=") and t > after
        ]

    def wait_for(self, field: str, timeout: float, count: int = 1, after: float = 0.0) -> float:
        """Arrival time of the `count`-th `field` after `after`."""
        times = wait_until(
            lambda: (t := self.times(field, after))[count - 1 :] and t,
            timeout,
            f"{count} x {field}",
        )
        return float(times[count - 1])

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)
        self._sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def notified(
    make_daemon: type[Daemon], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Daemon, NotifyListener]]:
    """A daemon started (not yet ready) under a notify socket with a 1 s watchdog."""
    d = make_daemon(
        *DISAGGREGATED, "--heartbeat-timeout", "3", "--restart-backoff", "2", "--drain-timeout", "5"
    )
    listener = NotifyListener(d.port)
    monkeypatch.setenv("NOTIFY_SOCKET", listener.path)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    try:
        d.start(wait=False)
        yield d, listener
    finally:
        d.close()
        listener.close()


def test_status_then_ready_once_the_port_listens_then_watchdog(
    notified: tuple[Daemon, NotifyListener],
) -> None:
    d, n = notified
    ready_at = n.wait_for("READY=1", START_TIMEOUT_S)
    assert n.port_open_at_ready == [True]  # READY=1 never comes before the port listens
    assert n.statuses()[0] == f"starting {WORKERS} workers"
    assert n.statuses(after=ready_at - 1e-3)[0] == f"serving {WORKERS} workers"
    assert d.wait_state("running", 5)["state"] == "running"
    n.wait_for("WATCHDOG=1", 10, count=4, after=ready_at)
    pings = n.times("WATCHDOG=1", after=ready_at)
    assert all(b - a > 0.3 for a, b in itertools.pairwise(pings))  # paced, no flood
    # The workers did not inherit the socket: only the supervisor speaks for the service.
    for w in d.status()["workers"]:
        env = psutil.Process(w["pid"]).environ()
        assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env


def test_drain_and_stop_are_reported(notified: tuple[Daemon, NotifyListener]) -> None:
    d, n = notified
    ready_at = n.wait_for("READY=1", START_TIMEOUT_S)
    d.wait_state("running", 5)
    assert d.control().post("/v1/drain").status_code == 200
    wait_until(lambda: "draining" in n.statuses(after=ready_at), 5, "STATUS=draining")
    assert not n.times("STOPPING=1")  # a drain keeps the service up
    assert d.control().post("/v1/resume").status_code == 200
    wait_until(lambda: n.statuses(after=ready_at)[-1] == f"serving {WORKERS} workers", 5, "serving")
    d.signal(signal.SIGTERM)
    stopping_at = n.wait_for("STOPPING=1", 10)
    assert d.wait_exit(timeout=20) == 0
    stop_fields = next(f for t, f in n.messages if t == stopping_at)
    assert stop_fields == ["STOPPING=1", "STATUS=stopping (SIGTERM)"]
    assert len(n.times("READY=1")) == 1


def test_a_hung_worker_stops_the_watchdog_until_it_is_replaced(
    notified: tuple[Daemon, NotifyListener],
) -> None:
    d, n = notified
    ready_at = n.wait_for("READY=1", START_TIMEOUT_S)
    n.wait_for("WATCHDOG=1", 10, count=2, after=ready_at)
    old = d.worker("prefill-0")
    stopped_at = time.monotonic()
    os.kill(old["pid"], signal.SIGSTOP)

    def replaced() -> bool:
        w = d.worker("prefill-0")
        return bool(w["state"] == "running" and w["pid"] != old["pid"])

    wait_until(replaced, 30, "the stopped worker to be replaced")
    replaced_at = time.monotonic()
    n.wait_for("WATCHDOG=1", 10, count=2, after=replaced_at)
    pings = n.times("WATCHDOG=1", after=stopped_at)
    # Within its heartbeat timeout (3 s) a silent worker does not stop the pings ...
    assert any(t < stopped_at + 1.5 for t in pings)
    # ... past it, the pings stop until the replacement is ready (restart backoff 2 s).
    gaps = [(a, b) for a, b in itertools.pairwise(pings) if b - a > 1.5]
    assert len(gaps) == 1, pings
    last_before, first_after = gaps[0]
    assert stopped_at + 1.0 < last_before < replaced_at
    assert first_after > replaced_at - 0.5
    assert "restarting prefill-0" in n.statuses(after=stopped_at)
    assert n.statuses()[-1] == f"serving {WORKERS} workers"
    assert len(n.times("READY=1")) == 1  # a worker restart is not a service restart


def test_reload_sends_reloading_then_ready(
    make_daemon: type[Daemon], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "lmd.toml"
    config.write_text('log_level = "info"\n')
    d = make_daemon(*DISAGGREGATED, "--config", str(config))
    n = NotifyListener(d.port)
    monkeypatch.setenv("NOTIFY_SOCKET", n.path)
    try:
        d.start()
        ready_at = n.wait_for("READY=1", START_TIMEOUT_S)
        config.write_text('log_level = "debug"\n')
        out = subprocess.run(
            [*LMDCTL, "--socket", str(d.socket_path), "reload"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert "applied: log_level (info -> debug)" in out.stdout
        reloading_at = n.wait_for("RELOADING=1", 5)
        ready_again_at = n.wait_for("READY=1", 5, after=ready_at)
        assert ready_at < reloading_at < ready_again_at
        fields = next(f for t, f in n.messages if t == reloading_at)
        assert fields[1].startswith("MONOTONIC_USEC=") and int(fields[1].split("=")[1]) > 0
        assert n.statuses()[-1] == f"serving {WORKERS} workers"
    finally:
        d.close()
        n.close()
