"""The control socket and lmdctl against a real daemon."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import orjson
import pytest

from lmd_client import ControlRequestError, DaemonNotRunning, SyncControlClient
from tests.integration.daemon import Daemon, wait_until

LMDCTL = [sys.executable, "-m", "lmd_client.lmdctl"]


def lmdctl(daemon: Daemon | None, *args: str) -> subprocess.CompletedProcess[str]:
    sock = str(daemon.socket_path) if daemon else "/nonexistent/lmd/control.sock"
    return subprocess.run(
        [*LMDCTL, "--socket", sock, *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_malformed_json_is_400_and_the_socket_stays_up(daemon: Daemon) -> None:
    ctl = daemon.control()
    for body in (b"{bad", b"[1, 2]", b"\xff\xfe"):
        r = ctl.post("/v1/drain", content=body)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "bad_json"
    assert daemon.status()["state"] == "running"  # and nothing was drained


def test_errors_are_structured(daemon: Daemon) -> None:
    ctl = daemon.control()
    r = ctl.get("/v1/nope")
    assert r.status_code == 404 and set(r.json()["error"]) == {"code", "message"}
    r = ctl.post("/v1/workers/decode-9/restart")
    assert r.status_code == 404 and "decode-9" in r.json()["error"]["message"]
    r = ctl.get("/v1/drain")
    assert r.status_code == 405
    r = ctl.post("/v1/resume")
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_draining"


def test_drain_and_resume(daemon: Daemon) -> None:
    assert lmdctl(daemon, "drain").returncode == 0
    assert daemon.status()["state"] == "draining"
    health = httpx.get(f"{daemon.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert lmdctl(daemon, "resume").returncode == 0
    wait_until(lambda: httpx.get(f"{daemon.url}/health").status_code == 200, 5, "health 200")


def test_status_json_shape(daemon: Daemon) -> None:
    out = lmdctl(daemon, "--json", "status")
    assert out.returncode == 0, out.stderr
    s = orjson.loads(out.stdout)
    assert {"state", "pid", "uptime_s", "model", "runtime_dir", "workers"} <= set(s)
    assert s["state"] == "running" and s["model"] == "SmolLM2-135M-Instruct"
    keys = {
        "name",
        "role",
        "pid",
        "state",
        "backend",
        "device",
        "restarts",
        "rss_bytes",
        "started_at",
    }
    for w in s["workers"]:
        assert keys <= set(w)
        assert w["role"] in ("tokenizer", "prefill", "decode", "api")


def test_global_options_after_the_subcommand_and_a_reader_gone(daemon: Daemon) -> None:
    out = subprocess.run(
        [*LMDCTL, "status", "--json", "--socket", str(daemon.socket_path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert orjson.loads(out.stdout)["state"] == "running"
    read, write = os.pipe()
    os.close(read)  # `lmdctl status | head -1` once head has gone
    try:
        gone = subprocess.run(
            [*LMDCTL, "--socket", str(daemon.socket_path), "status"],
            stdout=write,
            stderr=subprocess.PIPE,
            timeout=30,
            check=False,
        )
    finally:
        os.close(write)
    assert (gone.returncode, gone.stderr) == (141, b"")  # as coreutils killed by SIGPIPE


def test_sync_control_client(daemon: Daemon) -> None:
    with SyncControlClient(daemon.socket_path) as ctl:
        assert ctl.status()["state"] == "running"
        assert [w["name"] for w in ctl.workers()] == [
            "tokenizer-0",
            "prefill-0",
            "decode-0",
            "api-0",
        ]
        assert ctl.drain()["state"] == "draining"
        assert daemon.status()["state"] == "draining"
        assert ctl.resume()["state"] == "running"
        assert ctl.config()["values"]["port"] == daemon.port
        with pytest.raises(ControlRequestError) as refused:
            ctl.restart("decode-9")
        assert (refused.value.status, refused.value.code) == (404, "unknown_worker")
    with pytest.raises(DaemonNotRunning), SyncControlClient("/nonexistent/control.sock") as ctl:
        ctl.status()


def test_status_table(daemon: Daemon) -> None:
    out = lmdctl(daemon, "status")
    assert out.returncode == 0
    assert "lmdd 0.1.0 is running" in out.stdout
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("NAME"))
    names = [line.split()[0] for line in lines[header + 1 :]]
    assert names == ["tokenizer-0", "prefill-0", "decode-0", "api-0"]


def test_restart_via_lmdctl(daemon: Daemon) -> None:
    old = daemon.worker("tokenizer-0")["pid"]
    out = lmdctl(daemon, "restart", "tokenizer-0")
    assert out.returncode == 0 and "restarting tokenizer-0" in out.stdout
    wait_until(
        lambda: (
            daemon.worker("tokenizer-0")["pid"] not in (None, old)
            and daemon.worker("tokenizer-0")["state"] == "running"
        ),
        20,
        "restart",
    )
    assert daemon.worker("tokenizer-0")["restarts"] == 1


def test_unknown_worker_exits_1(daemon: Daemon) -> None:
    out = lmdctl(daemon, "restart", "nope-0")
    assert out.returncode == 1
    assert out.stderr.strip().startswith("lmdctl: no worker named 'nope-0'")


def test_no_daemon_exits_3() -> None:
    out = lmdctl(None, "status")
    assert out.returncode == 3
    assert out.stderr.strip() == (
        "lmdctl: lmdd is not running (no answer on /nonexistent/lmd/control.sock)"
    )


def test_shutdown_via_lmdctl(daemon: Daemon) -> None:
    assert lmdctl(daemon, "shutdown").returncode == 0
    assert daemon.wait_exit(timeout=20) == 0


def test_version(daemon: Daemon) -> None:
    out = lmdctl(daemon, "--json", "version")
    assert out.returncode == 0
    assert orjson.loads(out.stdout) == {
        "lmdctl": "0.1.0",
        "lmdd": "0.1.0",
        "pid": daemon.status()["pid"],
    }
    assert lmdctl(None, "version").returncode == 3  # no daemon: like status
