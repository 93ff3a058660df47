"""sd_notify against a real AF_UNIX datagram socket, as systemd listens on one."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmd.supervisor.sd_notify import Notifier
from lmd.supervisor.service_notify import ServiceNotifier, status_line
from lmd.supervisor.states import DaemonState, WorkerState


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket and the $NOTIFY_SOCKET value that names it.

    A short directory of its own: pytest's tmp_path can exceed a socket path's 108 bytes.
    """
    folder = tempfile.mkdtemp(prefix="sdn-")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    try:
        yield sock, path
    finally:
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_messages_arrive_as_newline_separated_fields(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": path}, pid=os.getpid())
    assert n.enabled and n.watchdog_interval is None
    assert n.ready("serving 4 workers")
    assert received(sock) == ["READY=1", "STATUS=serving 4 workers"]
    assert n.stopping("stopping (SIGTERM)")
    assert received(sock) == ["STOPPING=1", "STATUS=stopping (SIGTERM)"]
    assert n.watchdog()
    assert received(sock) == ["WATCHDOG=1"]
    before = time.monotonic_ns() // 1000
    assert n.reloading("reloading")
    fields = received(sock)
    assert fields[0] == "RELOADING=1" and fields[2] == "STATUS=reloading"
    key, usec = fields[1].split("=")
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= time.monotonic_ns() // 1000
    n.close()


def test_abstract_namespace_socket() -> None:
    name = f"lmd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name}, pid=1)
        assert n.status("starting 4 workers")
        assert received(sock) == ["STATUS=starting 4 workers"]
        n.close()


def test_without_notify_socket_every_call_is_a_no_op() -> None:
    n = Notifier.from_env({"WATCHDOG_USEC": "1000000"}, pid=os.getpid())
    assert not n.enabled and n.watchdog_interval is None
    assert not n.ready("x") and not n.watchdog() and not n.stopping("x")
    ServiceNotifier(n).watchdog(now=1e9, healthy=True)  # nothing to send to, no error


def test_unsupported_socket_kinds_are_ignored() -> None:
    assert not Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"}, pid=1).enabled
    assert not Notifier.from_env({"NOTIFY_SOCKET": "relative/path"}, pid=1).enabled


def test_watchdog_interval_is_half_of_watchdog_usec_for_our_pid() -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "3000000"}
    assert Notifier.from_env(env, pid=42).watchdog_interval == 1.5
    assert Notifier.from_env({**env, "WATCHDOG_PID": "42"}, pid=42).watchdog_interval == 1.5
    # Meant for another process (e.g. the variable leaked into a child): not ours.
    assert Notifier.from_env({**env, "WATCHDOG_PID": "41"}, pid=42).watchdog_interval is None
    for bad in ("0", "-5", "1.5s", "soon"):
        bad_env = {**env, "WATCHDOG_USEC": bad}
        assert Notifier.from_env(bad_env, pid=42).watchdog_interval is None


def test_from_environ_unsets_the_variables_for_children() -> None:
    environ = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "2000000", "PATH": "/bin"}
    n = Notifier.from_environ(environ)
    assert n.enabled and n.watchdog_interval == 1.0
    assert environ == {"PATH": "/bin"}


def test_a_vanished_manager_never_raises(tmp_path: Path) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone")}, pid=1)
    assert n.enabled and not n.ready("x") and not n.watchdog()
    n.close()


def test_watchdog_pings_when_due_and_only_while_healthy(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}
    service = ServiceNotifier(Notifier.from_env(env, pid=7))
    sent_at = []
    for tick in range(30):  # 3 s of 0.1 s ticks; unhealthy from 1.0 s to 2.0 s
        now = 100.0 + tick / 10
        service.watchdog(now, healthy=not 1.0 <= now - 100.0 < 2.0)
        sock.setblocking(False)
        try:
            assert received(sock) == ["WATCHDOG=1"]
            sent_at.append(round(now - 100.0, 1))
        except BlockingIOError:
            pass
    # Every 0.5 s while healthy, none while not, and at once when healthy again.
    assert sent_at == [0.0, 0.5, 2.0, 2.5]
    service.close()


def test_status_is_sent_only_when_it_changes(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    service = ServiceNotifier(Notifier.from_env({"NOTIFY_SOCKET": path}, pid=7))
    service.status("starting 4 workers")
    service.status("starting 4 workers")
    service.ready("serving 4 workers")
    assert received(sock) == ["STATUS=starting 4 workers"]
    assert received(sock) == ["READY=1", "STATUS=serving 4 workers"]
    with service.reloading(lambda: "serving 4 workers"):
        assert received(sock)[0] == "RELOADING=1"
    assert received(sock) == ["READY=1", "STATUS=serving 4 workers"]
    service.close()


def test_status_lines() -> None:
    up = {"tokenizer-0": WorkerState.RUNNING, "decode-0": WorkerState.RUNNING}
    down = {**up, "decode-0": WorkerState.RESTARTING}
    assert status_line(DaemonState.STARTING, down, "") == "starting 2 workers"
    assert status_line(DaemonState.RUNNING, up, "") == "serving 2 workers"
    assert status_line(DaemonState.RUNNING, down, "") == "restarting decode-0"
    assert status_line(DaemonState.DRAINING, up, "") == "draining"
    assert status_line(DaemonState.STOPPING, up, "SIGTERM") == "stopping (SIGTERM)"
