"""OpenAI's `n` in disaggregated mode, with two prefill and two decode workers (model-less
engines, real KV pools, prefix caches and migration): the choices of a request go to the
one prefill worker that cached its prompt, and a client leaving frees every choice."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.daemon import DISAGGREGATED, Daemon, served, wait_until

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 64
ENGINES = ("prefill-0", "prefill-1", "decode-0", "decode-1")


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    yield from served(Daemon(*DISAGGREGATED, "--prefill-workers", "2", "--decode-workers", "2"))


def fresh_prompt() -> str:
    """Several KV blocks that no earlier request cached."""
    return f"Note {uuid.uuid4().hex}: " + " ".join(f"w{i}" for i in range(120))


def cached_metric(daemon: Daemon) -> float:
    for line in httpx.get(f"{daemon.url}/metrics").text.splitlines():
        if line.startswith("lmd_prompt_tokens_cached_total "):
            return float(line.split()[1])
    raise AssertionError("no lmd_prompt_tokens_cached_total in /metrics")


def idle(daemon: Daemon) -> bool:
    workers = {w["name"]: w for w in daemon.status()["workers"]}
    free = all(workers[n]["kv"]["free_blocks"] == workers[n]["kv"]["total_blocks"] for n in ENGINES)
    return free and not any(w["inflight"] for w in workers.values())


def test_later_choices_find_the_prompt_in_their_prefill_worker_s_cache(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="none", max_retries=0)
    for _ in range(4):  # with two prefill workers, a request split over both would miss
        before = cached_metric(daemon)
        r = client.completions.create(model=MODEL, prompt=fresh_prompt(), n=3, max_tokens=8)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.usage is not None and r.usage.completion_tokens == 3 * 8
        full_blocks = (r.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert full_blocks >= 3 * BLOCK_SIZE
        assert cached_metric(daemon) - before == 2 * full_blocks
    wait_until(lambda: idle(daemon), 10, "every block free, nothing in flight")


def test_a_client_leaving_a_stream_of_three_frees_every_worker(daemon: Daemon) -> None:
    body = {
        "model": MODEL, "prompt": fresh_prompt(), "n": 3, "max_tokens": 2000,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    seen: set[int] = set()
    with httpx.stream("POST", f"{daemon.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        while seen != {0, 1, 2}:
            line = next(lines)
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
    wait_until(lambda: idle(daemon), 10, "the aborted choices freed everywhere")
    status = daemon.status()
    assert all((w["restarts"], w["num_dropped"]) == (0, 0) for w in status["workers"])
