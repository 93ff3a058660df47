"""Soak (issue 9's shape, on model-less engines so that the serving path is what runs):
many requests at concurrency 64 with random prompt and output lengths, streamed or not,
10% of clients leaving early. Nothing is lost: each request that stayed gets its whole
answer (or a clear error); no KV block, in-flight request or session is left over; the
daemon processes' memory stays flat after warm-up.

The default run (CI) sends 400 requests; `-m slow` runs the 2,000 the issue asks for.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.integration.daemon import DISAGGREGATED, Daemon, served, wait_until

MODEL = "SmolLM2-135M-Instruct"
CONCURRENCY = 64


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    yield from served(
        Daemon(*DISAGGREGATED, "--heartbeat-interval", "0.5", "--heartbeat-timeout", "10")
    )


def rss(daemon: Daemon) -> dict[str, int]:
    return {w["name"]: w["rss_bytes"] for w in daemon.status()["workers"]}


def soak(daemon: Daemon, num_requests: int, seed: int) -> None:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    bad: list[str] = []
    warm: dict[str, int] = {}

    async def one(http: httpx.AsyncClient, i: int) -> None:
        max_tokens = rng.randint(1, 200)
        body = {
            "model": MODEL,
            "prompt": " ".join(
                rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(1, 300))
            ),
            "max_tokens": max_tokens,
            "stream": rng.random() < 0.5,
            # The fake engine's logits make sampling near uniform: eos could come at any
            # token, so every request runs to its max_tokens (finish_reason "length").
            "ignore_eos": True,
        }
        leave_after = rng.uniform(0.0, 0.3) if rng.random() < 0.1 else None
        try:
            async with asyncio.timeout(leave_after):
                if body["stream"]:
                    finish = None
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            event = orjson.loads(line[6:])
                            if "error" in event:
                                bad.append(line[:300])
                            elif event["choices"] and event["choices"][0]["finish_reason"]:
                                finish = event["choices"][0]["finish_reason"]
                    ok = r.status_code == 200 and finish == "length"
                    if not ok:
                        bad.append(f"stream {i}: HTTP {r.status_code}, finish {finish}")
                else:
                    r = await http.post("/v1/completions", json=body)
                    ok = (
                        r.status_code == 200
                        and r.json()["usage"]["completion_tokens"] == max_tokens
                    )
                    if not ok:
                        bad.append(f"{i}: HTTP {r.status_code} {r.text[:300]}")
            outcomes["complete" if ok else "failed"] += 1
        except TimeoutError:
            if leave_after is None:
                raise
            outcomes["left"] += 1

    async def run() -> None:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(
            base_url=daemon.url, timeout=120, limits=httpx.Limits(max_connections=CONCURRENCY)
        ) as http:

            async def gated(i: int) -> None:
                async with gate:
                    await one(http, i)
                if i == num_requests // 5:  # warmed up: the memory baseline
                    warm.update(await asyncio.to_thread(rss, daemon))

            await asyncio.gather(*(gated(i) for i in range(num_requests)))

    asyncio.run(run())
    assert outcomes["failed"] == 0, bad[:5]
    assert outcomes["complete"] + outcomes["left"] == num_requests
    nothing_left_over(daemon)
    after = rss(daemon)
    grown = {n: round(after[n] / warm[n], 3) for n in warm if warm[n]}
    print(f"{outcomes}; RSS after / after warm-up: {grown}")
    assert all(g <= 1.10 for g in grown.values()), grown  # flat within 10% after warm-up


def nothing_left_over(daemon: Daemon) -> None:
    engines = ["prefill-0", "decode-0"]
    wait_until(
        lambda: all(
            daemon.worker(n)["kv"]["free_blocks"] == daemon.worker(n)["kv"]["total_blocks"]
            for n in engines
        ),
        10,
        "every KV block free",
    )
    for name in ("tokenizer-0", *engines, "api-0"):
        wait_until(lambda n=name: daemon.worker(n)["inflight"] == 0, 10, f"{name} idle")  # type: ignore[misc]
    assert daemon.worker("tokenizer-0")["sessions"] == 0
    assert all(w["restarts"] == 0 for w in daemon.status()["workers"])


def test_soak_short(daemon: Daemon) -> None:
    soak(daemon, 400, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_2000_requests(daemon: Daemon) -> None:
    soak(daemon, 2000, seed=2)
