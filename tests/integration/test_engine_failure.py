"""A request whose engine dies ends with an error at once; the daemon serves again after."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.integration.daemon import Daemon, served, wait_until


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    yield from served(
        Daemon("--mode", "hybrid", "--heartbeat-timeout", "5", "--session-len", "2048")
    )


def test_engine_killed_mid_stream_fails_the_stream_then_recovers(daemon: Daemon) -> None:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[dict[str, object]] = []
    with httpx.Client(base_url=daemon.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            killed_at = 0.0
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(orjson.loads(line[6:]))
                if len(events) == 5:
                    killed_at = time.monotonic()
                    os.kill(daemon.worker("hybrid-0")["pid"], signal.SIGKILL)
            ended_after = time.monotonic() - killed_at
        assert "error" in events[-1], events[-1]  # an error event, not a silent end
        assert ended_after < 10
        wait_until(lambda: daemon.worker("hybrid-0")["state"] == "running", 60, "engine back")
        wait_until(lambda: http.get("/health").status_code == 200, 30, "health back")
        again = http.post(
            "/v1/chat/completions",
            json={**body, "stream": False, "max_tokens": 8},
        )
        assert again.status_code == 200
        assert again.json()["usage"]["completion_tokens"] == 8
    # In-flight counts travel on heartbeats (every second): wait for a fresh one.
    for name in ("tokenizer-0", "hybrid-0", "api-0"):
        wait_until(lambda n=name: daemon.worker(n)["inflight"] == 0, 5, f"{name} idle")  # type: ignore[misc]
    kv = daemon.worker("hybrid-0")["kv"]
    assert kv["free_blocks"] == kv["total_blocks"]
