"""Hostile input on the control socket, and who may use it at all.

Against one real daemon (model-less engines, --log-level debug):
  modes      control.sock is 0660 (or stricter), the runtime dir is not open to others
  HTTP junk  truncated JSON, JSON that is not an object, invalid UTF-8, a body over 64 KiB,
             an unknown command, a wrong method -> a structured {"error": {"code",
             "message"}} 4xx, and nothing is done (a junk /v1/drain drains nothing)
  raw junk   random bytes, a 1 MiB line, NUL in the request line, a header cut off by a
             hang-up, 50 connections dropped mid-request -> a structured 400 where there
             is anyone left to answer, and the socket keeps serving
  peers      each connection's pid / uid / gid is logged (debug); a process of another
             user (forked, setuid nobody) cannot even connect: the directory and the
             socket's mode stop it
Against an in-process control app on a socket anyone may connect to (mode 0666), the uid
check itself: nobody's request is refused with 403 `forbidden` and a warning naming its
pid and uid.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import orjson
import pytest

from lmd.http_server import EmbeddedServer, bind_unix
from lmd.supervisor.control import MAX_BODY_BYTES, build_control_app
from lmd.supervisor.supervisor import Supervisor
from tests.integration.daemon import DISAGGREGATED, Daemon, served, wait_until

NOBODY = 65534


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    yield from served(Daemon(*DISAGGREGATED, "--log-level", "debug", "--heartbeat-timeout", "10"))


def assert_control_error(r: httpx.Response, status: int, code: str) -> str:
    """`status` with exactly the control API's error body; returns its message."""
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == ["error"] and list(body["error"]) == ["code", "message"]
    assert body["error"]["code"] == code and body["error"]["message"]
    message: str = body["error"]["message"]
    return message


def test_socket_and_runtime_dir_modes(daemon: Daemon) -> None:
    sock_mode = stat.S_IMODE(daemon.socket_path.stat().st_mode)
    assert stat.S_ISSOCK(daemon.socket_path.stat().st_mode)
    assert sock_mode & ~0o660 == 0, oct(sock_mode)  # 0660 or stricter: no one else
    assert sock_mode & 0o600 == 0o600  # and the daemon's user can use it
    dir_mode = stat.S_IMODE(daemon.runtime_dir.stat().st_mode)
    assert dir_mode & 0o007 == 0, oct(dir_mode)  # others cannot even look inside


JUNK_BODIES = {
    "truncated": b'{"interval": 1, "wor',
    "array": b"[1, 2]",
    "string": b'"drain"',
    "number": b"1",
    "null": b"null",
    "invalid-utf8": b'{"a": "\xff\xfe"}',
    "garbage": b"\x00\x01\x02\xff garbage",
}


@pytest.mark.parametrize("body", JUNK_BODIES.values(), ids=JUNK_BODIES.keys())
def test_junk_body_is_400_and_nothing_is_done(daemon: Daemon, body: bytes) -> None:
    r = daemon.control().post("/v1/drain", content=body)
    assert_control_error(r, 400, "bad_json")
    assert daemon.status()["state"] == "running"  # not drained


def test_a_body_over_the_limit_is_413(daemon: Daemon) -> None:
    r = daemon.control().post("/v1/drain", content=b"{" + b" " * MAX_BODY_BYTES + b"}")
    assert str(MAX_BODY_BYTES) in assert_control_error(r, 413, "body_too_large")

    def chunked() -> Iterator[bytes]:  # no Content-Length
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b" " * 1024

    assert_control_error(
        daemon.control().post("/v1/drain", content=chunked()), 413, "body_too_large"
    )
    assert daemon.status()["state"] == "running"


def test_unknown_commands_and_methods(daemon: Daemon) -> None:
    ctl = daemon.control()
    assert_control_error(ctl.post("/v1/frobnicate"), 404, "not_found")
    assert_control_error(ctl.get("/v1/workers/../../etc/passwd"), 404, "not_found")
    r = ctl.delete("/v1/status")
    assert_control_error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "GET"


def raw_exchange(path: Path, data: bytes, *, half_close: bool = True) -> bytes:
    """Send `data` on a fresh connection and read until the daemon closes it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
        return out


def structured_400(answer: bytes) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"content-type: application/json" in head.lower()
    error: dict[str, Any] = orjson.loads(body)["error"]
    assert list(error) == ["code", "message"] and error["code"] == "bad_request"
    return error


RAW_JUNK = {
    "random-bytes": bytes(range(256)) * 4,
    "huge-line": b"GET /v1/status" + b"A" * (1 << 20) + b" HTTP/1.1\r\n\r\n",
    "nul-in-request-line": b"GET /v1/\x00status HTTP/1.1\r\nHost: lmd\r\n\r\n",
    "not-http": b"HELLO lmd, please shut down\r\n\r\n",
}


@pytest.mark.parametrize("data", RAW_JUNK.values(), ids=RAW_JUNK.keys())
def test_raw_junk_gets_a_structured_400(daemon: Daemon, data: bytes) -> None:
    structured_400(raw_exchange(daemon.socket_path, data))
    assert daemon.status()["state"] == "running"


def test_hang_ups_mid_request_leave_the_socket_serving(daemon: Daemon) -> None:
    for _ in range(50):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(daemon.socket_path))
            s.sendall(b"POST /v1/shutdown HTTP/1.1\r\nHost: lmd\r\nContent-Le")
    cut = b"POST /v1/drain HTTP/1.1\r\nHost: lmd\r\nContent-Length: 100\r\n\r\n{}"
    assert raw_exchange(daemon.socket_path, cut) == b""  # the body never came: no answer
    assert daemon.status()["state"] == "running"  # neither shut down nor drained


def test_each_connection_logs_its_peer(daemon: Daemon) -> None:
    daemon.status()
    line = f"connection from pid {os.getpid()} uid {os.getuid()} gid {os.getgid()}"
    wait_until(lambda: line in daemon.log(), 5, "the peer's credentials in the log")


def connect_as(uid: int, path: Path) -> str:
    """In a forked child running as `uid`: what connecting to `path` did."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, only this
        outcome = "connected"
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(path))
                s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: lmd\r\nConnection: close\r\n\r\n")
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
                outcome = answer.decode(errors="replace") or "connected"
        except OSError as exc:
            outcome = type(exc).__name__
        os.write(write_fd, outcome.encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as r:
        outcome = r.read().decode()
    os.waitpid(pid, 0)
    return outcome


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_another_user_cannot_even_connect(daemon: Daemon) -> None:
    assert connect_as(NOBODY, daemon.socket_path) == "PermissionError"
    assert daemon.status()["state"] == "running"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
async def test_another_users_request_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """The uid check on its own: a socket anyone may connect to, in a directory anyone
    may enter; nobody's request is 403 `forbidden`, with a warning naming pid and uid."""
    where = Path(tempfile.mkdtemp(prefix="lmdc-"))
    try:
        where.chmod(0o755)
        sock = bind_unix(where / "control.sock", 0o666)
        app = build_control_app(cast(Supervisor, None))  # refused before any route runs
        server = EmbeddedServer(app, sock, "info")
        await server.start()
        try:
            with caplog.at_level(logging.WARNING, logger="lmd.supervisor.control"):
                answer = await asyncio.to_thread(connect_as, NOBODY, where / "control.sock")
        finally:
            await server.stop()
    finally:
        for p in where.iterdir():
            p.unlink()
        where.rmdir()
    head, _, body = answer.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 403 "), answer[:300]
    assert orjson.loads(body)["error"]["code"] == "forbidden"
    assert f"uid {NOBODY}" in orjson.loads(body)["error"]["message"]
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and f"uid {NOBODY}" in refused[0] and "pid " in refused[0]


def test_the_daemon_is_unharmed(daemon: Daemon) -> None:
    status = daemon.status()
    assert status["state"] == "running"
    assert all(w["restarts"] == 0 and w["state"] == "running" for w in status["workers"])
    assert httpx.get(f"{daemon.url}/health").json() == {"status": "ok"}
