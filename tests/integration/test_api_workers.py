"""`--api-workers 2` against a real daemon (hybrid, the fake backend): both api processes
listen on one port and take connections, /metrics adds up both whichever answers, a
second daemon cannot take the port, and an api killed comes back while the other serves."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.daemon import Daemon, alive, served, wait_until

APIS = ("api-0", "api-1")


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    yield from served(Daemon(
        "--mode", "hybrid", "--decode-backend", "fake", "--api-workers", "2",
        "--heartbeat-timeout", "10",
    ))  # fmt: skip


def complete(daemon: Daemon) -> httpx.Response:
    """One request on a connection of its own (the kernel picks the api for each)."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 3}
    return httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=60)


def admitted(daemon: Daemon, name: str) -> int:
    """Requests the api `name` admitted (its `api` stage), by its heartbeat."""
    return int(daemon.worker(name).get("stages", {}).get("api", {}).get("count", 0))


def series(text: str, name: str) -> float:
    """A series' value on /metrics; 0 before its first count."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return 0.0 if match is None else float(match.group(1))


def answered(daemon: Daemon) -> float:
    text = httpx.get(f"{daemon.url}/metrics", timeout=10).text
    return series(text, 'lmd_requests_total{endpoint="completions",status="200"}')


def test_both_apis_answer_and_metrics_add_up(daemon: Daemon) -> None:
    before = answered(daemon)
    answers = [complete(daemon) for _ in range(24)]
    assert [r.status_code for r in answers] == [200] * 24
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in answers)
    wait_until(lambda: sum(admitted(daemon, n) for n in APIS) >= 24, 10, "both heartbeats")
    # 24 connections hashed over two sockets: each gets some (all on one: 2^-23)
    assert all(admitted(daemon, n) > 0 for n in APIS)
    # whichever api answers the scrape, it counts the other's requests too
    assert {answered(daemon) - before for _ in range(8)} == {24.0}
    text = httpx.get(f"{daemon.url}/metrics", timeout=10).text
    assert "lmd_requests_running 0.0" in text


def test_a_second_daemon_cannot_share_the_port(daemon: Daemon) -> None:
    other = Daemon("--mode", "hybrid", "--decode-backend", "fake", "--api-workers", "2",
                   port=daemon.port)  # fmt: skip
    try:
        other.start(wait=False)
        assert other.wait_exit(timeout=60) == 1
        assert f"cannot listen on 127.0.0.1:{daemon.port}" in other.log()
    finally:
        other.close()
    assert complete(daemon).status_code == 200


def test_a_killed_api_comes_back_and_the_other_serves_meanwhile(daemon: Daemon) -> None:
    before = answered(daemon)
    pid = daemon.worker("api-1")["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), 10, "api-1 gone")
    # its socket closed with it: new connections go to api-0 (or to api-1 once back)
    answers = [complete(daemon) for _ in range(8)]
    wait_until(lambda: daemon.worker("api-1")["pid"] not in (None, pid), 60, "api-1 restarted")
    wait_until(lambda: daemon.worker("api-1")["state"] == "running", 60, "api-1 running")
    answers += [complete(daemon) for _ in range(8)]
    assert [r.status_code for r in answers] == [200] * 16
    assert daemon.worker("api-1")["restarts"] == 1
    assert daemon.worker("api-0")["restarts"] == 0
    # the dead process's counts stay in the sum: counters never go down
    assert answered(daemon) - before == 16.0
