"""`--tokenizer-workers 2` against a real daemon (SmolLM2 on CPU, hybrid): requests spread
over both tokenizers, a session's turns stay on one, and a tokenizer killed comes back
while the other serves on."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.daemon import Daemon, served, wait_until


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    yield from served(
        Daemon("--mode", "hybrid", "--tokenizer-workers", "2", "--heartbeat-timeout", "10")
    )


def complete(daemon: Daemon, prompt: str) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4}
    return httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=60)


def tokenized(daemon: Daemon, name: str) -> int:
    """Requests the tokenizer `name` has handed to an engine (its `tokenizer` stage)."""
    stage = daemon.worker(name).get("stages", {}).get("tokenizer", {})
    return int(stage.get("count", 0))


def test_requests_spread_over_both_tokenizers(daemon: Daemon) -> None:
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: complete(daemon, f"Count to {i}:"), range(8)))
    assert [r.status_code for r in answers] == [200] * 8
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in answers)
    both = lambda: tokenized(daemon, "tokenizer-0") + tokenized(daemon, "tokenizer-1") >= 8  # noqa: E731
    wait_until(both, 10, "both tokenizers' heartbeats")
    assert tokenized(daemon, "tokenizer-0") >= 4 and tokenized(daemon, "tokenizer-1") >= 4


def test_a_session_keeps_its_history_across_turns(daemon: Daemon) -> None:
    url = f"{daemon.url}/v1/chat/interactive"
    for session in (6, 7):  # one on each tokenizer
        first = {"prompt": "Hi, I am Ann.", "session_id": session, "interactive_mode": True,
                 "request_output_len": 4}  # fmt: skip
        one = httpx.post(url, json=first, timeout=60).json()
        two = httpx.post(url, json={**first, "prompt": "Who am I?"}, timeout=60).json()
        assert one["history_tokens"] == 0
        assert two["history_tokens"] >= one["input_tokens"] + one["tokens"]  # + the turn end


def test_a_killed_tokenizer_comes_back_and_the_other_serves_meanwhile(daemon: Daemon) -> None:
    pid = daemon.worker("tokenizer-1")["pid"]
    os.kill(pid, signal.SIGKILL)
    restarted = lambda: daemon.worker("tokenizer-1")["pid"] not in (None, pid)  # noqa: E731
    wait_until(restarted, 60, "tokenizer-1 restarted")
    wait_until(lambda: daemon.worker("tokenizer-1")["state"] == "running", 60, "it running")
    answers = [complete(daemon, "Hello") for _ in range(4)]
    assert [r.status_code for r in answers] == [200] * 4
    assert daemon.worker("tokenizer-1")["restarts"] == 1
    assert daemon.worker("tokenizer-0")["restarts"] == 0
