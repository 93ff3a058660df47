"""Start, stop, crash and restart a real daemon (tokenizer, prefill, decode, api)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.daemon import DISAGGREGATED, Daemon, alive, wait_until

ROLES = ["tokenizer-0", "prefill-0", "decode-0", "api-0"]


def test_start_reports_every_worker_running(daemon: Daemon) -> None:
    status = daemon.status()
    assert status["state"] == "running"
    assert status["runtime_dir"] == str(daemon.runtime_dir)
    assert [w["name"] for w in status["workers"]] == ROLES
    for w in status["workers"]:
        assert w["state"] == "running" and alive(w["pid"]) and w["rss_bytes"] > 0
    engine = {w["name"]: w for w in status["workers"]}
    assert engine["decode-0"]["device"] == "cpu"
    mode = stat.S_IMODE(os.stat(daemon.socket_path).st_mode)
    assert mode == 0o660
    health = httpx.get(f"{daemon.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # ps names each process, not `python -B -c from multiprocessing.spawn import ...`
    assert daemon.proc is not None and ps_args(daemon.proc.pid) == "lmd: supervisor"
    assert {w["name"]: ps_args(w["pid"]) for w in status["workers"]} == {
        name: f"lmd: {name}" for name in ROLES
    }


def test_a_file_that_is_no_model_exits_1_at_once_spawning_nothing(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    runtime = tmp_path / "rt"
    out = subprocess.run(
        [sys.executable, "-m", "lmd", "serve", str(notes), "--runtime-dir", str(runtime)],
        capture_output=True,
        text=True,
        timeout=60,  # it used to restart its workers for about 30-50 s, then exit 1
        check=False,
    )
    assert out.returncode == 1
    assert out.stderr == (
        f"lmdd: model {notes} is not a supported file: give a local Hugging Face directory "
        "(config.json + *.safetensors) or a .gguf file\n"
    )
    assert not runtime.exists()  # no socket, no lock: no worker was spawned


def ps_args(pid: int) -> str:
    """The command line as `ps -o args` shows it (/proc/PID/cmdline, NULs as spaces)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def test_sigterm_exits_0_and_leaves_nothing(daemon: Daemon) -> None:
    pids = [w["pid"] for w in daemon.status()["workers"]]
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(timeout=20) == 0
    assert not [p for p in pids if alive(p)]
    assert not [*daemon.runtime_dir.glob("*.sock"), *daemon.runtime_dir.glob("*.ipc")]
    log = daemon.log()
    assert "lmdd stopped (exit code 0)" in log
    # the workers exit without the modules' teardown: no report of Triton's "leaks"
    assert "nanobind" not in log and "leaked" not in log


@pytest.mark.parametrize("name", ROLES)
def test_kill_9_worker_is_restarted(daemon: Daemon, name: str) -> None:
    old = daemon.worker(name)
    killed_at = time.monotonic()
    os.kill(old["pid"], signal.SIGKILL)

    def back() -> bool:
        w = daemon.worker(name)
        return bool(w["state"] == "running" and w["pid"] != old["pid"])

    wait_until(back, 30, f"{name} to come back")
    took = time.monotonic() - killed_at
    new = daemon.worker(name)
    assert new["restarts"] == 1 and new["last_exit_code"] == -9
    assert alive(new["pid"]) and not alive(old["pid"])
    assert daemon.status()["state"] == "running"
    print(f"{name} back {took:.2f} s after kill -9")
    if name == "api-0":
        wait_until(
            lambda: httpx.get(f"{daemon.url}/health").status_code == 200,
            10,
            "api health after restart",
        )


def test_supervisor_sigkill_takes_every_child_with_it(daemon: Daemon) -> None:
    pids = [w["pid"] for w in daemon.status()["workers"]]
    daemon.signal(signal.SIGKILL)
    daemon.wait_exit(timeout=5)
    wait_until(lambda: not [p for p in pids if alive(p)], 10, "children to die")


def test_second_daemon_on_same_runtime_dir_refuses(
    daemon: Daemon, make_daemon: type[Daemon]
) -> None:
    second = make_daemon(*DISAGGREGATED, runtime_dir=daemon.runtime_dir).start(wait=False)
    assert second.wait_exit(timeout=30) == 1
    first_pid = daemon.status()["pid"]
    assert f"another lmdd (pid {first_pid}) is running" in second.log()
    assert daemon.status()["state"] == "running"


def test_stale_sockets_of_a_crashed_daemon_are_cleaned(make_daemon: type[Daemon]) -> None:
    first = make_daemon(*DISAGGREGATED).start()
    first.signal(signal.SIGKILL)
    first.wait_exit(timeout=5)
    assert first.socket_path.exists()  # a crash leaves its socket behind
    again = make_daemon(*DISAGGREGATED, runtime_dir=first.runtime_dir).start()
    assert again.status()["state"] == "running"
    assert "stale sockets" in again.log()


def test_gives_up_with_nonzero_exit_after_fast_failures(make_daemon: type[Daemon]) -> None:
    with socket.socket() as taken:  # the api cannot bind its port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = make_daemon(
            *DISAGGREGATED, "--restart-backoff", "0.1", "--max-fast-failures", "3", port=port
        )
        d.start(wait=False)
        assert d.wait_exit(timeout=60) == 1
    log = d.log()
    assert f"cannot listen on 127.0.0.1:{port}" in log
    assert "giving up: api-0 died 3 times in a row" in log
    wait_until(lambda: not d.child_pids(), 10, "no children left")


def test_sigstop_worker_misses_heartbeats_and_is_replaced(daemon: Daemon) -> None:
    old = daemon.worker("prefill-0")
    os.kill(old["pid"], signal.SIGSTOP)
    wait_until(
        lambda: daemon.worker("prefill-0")["pid"] not in (None, old["pid"]),
        20,
        "the stopped worker to be replaced",
    )
    assert not alive(old["pid"])
    assert "sent no heartbeat" in daemon.log()


def test_quantization_on_engines_that_cannot_run_it_exits_2_at_once(tmp_path: Path) -> None:
    """The engines would fail at start (turbo only, CUDA only) and be restarted until the
    daemon gave up: lmdd says so first, spawning nothing."""
    runtime = tmp_path / "rt"
    out = subprocess.run(
        [sys.executable, "-m", "lmd", "serve", "--device", "cpu", "--quantization", "w4a16",
         "--runtime-dir", str(runtime)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr == (
        "lmdd: quantization: --quantization w4a16 runs on backend turbo on CUDA only, and the "
        "decode engines would run backend auto on cpu\n"
    )
    assert not list(runtime.glob("*.ipc"))
