"""Chaos under load (issue 9): 32 streaming requests in flight, then one worker is killed
(SIGKILL) or frozen (SIGSTOP). What a user must see:

- no request hangs: each one either completes or ends with an error event, a 5xx or a
  closed connection, within 10 s of the fault (a frozen worker: within its heartbeat
  timeout plus 10 s);
- `/health` says 503 while the role is missing and 200 once it is back;
- the supervisor replaces the worker, and new requests succeed;
- once idle, every engine's KV blocks are all free and nothing is in flight;
- no orphan: the old process is gone and every child of the supervisor is a worker
  it lists.

The engines are model-less (fake backends, real KV pools and migration), so the test
exercises the serving path, not a model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import orjson
import psutil
import pytest

from tests.integration.daemon import DISAGGREGATED, Daemon, alive, served, wait_until

MODEL = "SmolLM2-135M-Instruct"
IN_FLIGHT = 32
LATE = 8
MAX_TOKENS = 600
HEARTBEAT_TIMEOUT_S = 4.0
ENDS_WITHIN_S = 10.0
ENGINES = ["prefill-0", "decode-0"]


@dataclass
class Stream:
    tokens: int = 0
    sent_at: float = 0.0
    outcome: str = "pending"  # complete, error event, HTTP NNN, connection lost
    ended_at: float = 0.0


def start(heartbeat_timeout_s: float) -> Iterator[Daemon]:
    yield from served(
        Daemon(
            *DISAGGREGATED,
            "--heartbeat-interval",
            "0.5",
            "--heartbeat-timeout",
            str(heartbeat_timeout_s),
            "--restart-backoff",
            "0.2",
        )
    )


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    # A long heartbeat timeout: on a busy 2-core runner, a short one can kill workers
    # that are merely slow, which is not the fault under test.
    yield from start(heartbeat_timeout_s=15.0)


@pytest.fixture
def daemon_short_heartbeat() -> Iterator[Daemon]:
    yield from start(HEARTBEAT_TIMEOUT_S)


async def stream_one(
    http: httpx.AsyncClient, s: Stream, started: asyncio.Event, max_tokens: int
) -> None:
    body = {
        "model": MODEL,
        "prompt": "chaos " * 50,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,  # the fake engine's tokens are near uniform: no early eos
    }
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.outcome = f"HTTP {r.status_code}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = orjson.loads(line[6:])
                if "error" in event:
                    s.outcome = "error event"
                    return
                choice = event["choices"][0] if event["choices"] else None
                if choice and choice["text"]:
                    s.tokens += 1
                    started.set()
                if choice and choice["finish_reason"]:
                    s.outcome = "complete" if choice["finish_reason"] == "length" else "error event"
            if s.outcome == "pending":
                s.outcome = "stream cut"
    except httpx.TransportError:
        s.outcome = "connection lost"
    finally:
        s.ended_at = time.monotonic()


async def late_one(http: httpx.AsyncClient, s: Stream) -> None:
    """A request sent just after the fault: it completes (perhaps after the restart) or
    gets an OpenAI error body at once; it never waits forever."""
    body = {"model": MODEL, "prompt": "late", "max_tokens": 20, "ignore_eos": True}
    s.sent_at = time.monotonic()
    try:
        r = await http.post("/v1/completions", json=body)
        if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20:
            s.outcome = "complete"
        else:
            error = r.json()["error"]
            assert error["message"] and error["type"], r.text
            s.outcome = f"HTTP {r.status_code}"
    except httpx.TransportError:
        s.outcome = "connection lost"
    finally:
        s.ended_at = time.monotonic()


def health_code(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code
    except httpx.TransportError:
        return 0  # the api itself is down: no answer at all


async def watch_health(url: str, seen: Counter[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        seen[await asyncio.to_thread(health_code, url)] += 1
        await asyncio.sleep(0.05)


@dataclass
class Outcome:
    streams: list[Stream]  # in flight at the fault
    late: list[Stream]  # sent just after it
    fault_at: float
    health: Counter[int]  # /health codes from the fault until the worker ran again

    def summary(self) -> str:
        def count(group: list[Stream]) -> str:
            return ", ".join(f"{n} {o}" for o, n in Counter(s.outcome for s in group).items())

        failed = [s.ended_at - self.fault_at for s in self.streams if s.outcome != "complete"]
        return (
            f"in flight: {count(self.streams)} (last failure {max(failed, default=0):.2f} s "
            f"after the fault); sent after: {count(self.late)}; /health: {dict(self.health)}"
        )


def inject(daemon: Daemon, name: str, sig: signal.Signals, max_tokens: int = MAX_TOKENS) -> Outcome:
    """Start IN_FLIGHT streams; once each has a token, send `sig` to worker `name`, and
    LATE more requests at once; wait until every request has ended."""
    pid = daemon.worker(name)["pid"]
    streams = [Stream() for _ in range(IN_FLIGHT)]
    late = [Stream() for _ in range(LATE)]
    health: Counter[int] = Counter()

    async def run() -> float:
        # A connection for every request: the late ones go out at once, not when streams
        # in flight end (their time would count the streams' time).
        limits = httpx.Limits(max_connections=IN_FLIGHT + LATE)
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120, limits=limits) as http:
            started = [asyncio.Event() for _ in streams]
            tasks = [
                asyncio.create_task(stream_one(http, s, e, max_tokens))
                for s, e in zip(streams, started, strict=True)
            ]
            async with asyncio.timeout(60):
                await asyncio.gather(*(e.wait() for e in started))
            fault_at = time.monotonic()
            os.kill(pid, sig)
            tasks += [asyncio.create_task(late_one(http, s)) for s in late]
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch_health(daemon.url, health, stop))
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    daemon.worker(name)["pid"] not in (None, pid)
                    and daemon.worker(name)["state"] == "running"
                ),
                60,
                f"{name} to be replaced",
            )
            await asyncio.to_thread(
                wait_until, lambda: health_code(daemon.url) == 200, 30, "/health 200"
            )
            stop.set()
            await watcher
            async with asyncio.timeout(120):  # a hung request fails the test here
                await asyncio.gather(*tasks)
            return fault_at

    fault_at = asyncio.run(run())
    return Outcome(streams, late, fault_at, health)


def assert_recovered(daemon: Daemon, name: str, old_pid: int) -> None:
    assert not alive(old_pid), f"{name}'s old process {old_pid} outlived its replacement"
    assert daemon.worker(name)["restarts"] == 1
    # New requests succeed, streamed and not.
    for stream in (False, True):
        r = httpx.post(
            f"{daemon.url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": "after",
                "max_tokens": 20,
                "ignore_eos": True,
                "stream": stream,
            },
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert ("[DONE]" in r.text) if stream else r.json()["usage"]["completion_tokens"] == 20
    wait_until(
        lambda: all(
            (w := daemon.worker(n))["kv"]["free_blocks"] == w["kv"]["total_blocks"] for n in ENGINES
        ),
        15,
        "every KV block free",
    )
    for w in daemon.status()["workers"]:
        wait_until(lambda n=w["name"]: daemon.worker(n)["inflight"] == 0, 15, f"{w['name']} idle")  # type: ignore[misc]
    assert daemon.worker("tokenizer-0")["sessions"] == 0
    listed = {w["pid"] for w in daemon.status()["workers"]}
    assert daemon.proc is not None
    children = {
        p.pid
        for p in psutil.Process(daemon.proc.pid).children()
        if "resource_tracker" not in " ".join(p.cmdline())  # multiprocessing's own helper
    }
    assert children == listed, f"children {children} but workers {listed}"


def assert_nothing_hung(outcome: Outcome, ends_within_s: float) -> None:
    for s in outcome.streams:
        assert s.outcome != "pending", outcome.summary()
        if s.outcome != "complete":
            assert s.ended_at - outcome.fault_at <= ends_within_s, outcome.summary()
    for s in outcome.late:
        assert s.outcome == "complete" or s.ended_at - s.sent_at <= ends_within_s, outcome.summary()


@pytest.mark.parametrize("name", ["tokenizer-0", "prefill-0", "decode-0", "api-0"])
def test_sigkill_under_load(daemon: Daemon, name: str) -> None:
    old_pid = daemon.worker(name)["pid"]
    # The api's clients vanish with it; long answers show that the engines stop
    # computing for them (the session length caps max_tokens).
    max_tokens = 100_000 if name == "api-0" else MAX_TOKENS
    outcome = inject(daemon, name, signal.SIGKILL, max_tokens)
    print(f"kill -9 {name}: {outcome.summary()}")
    assert_nothing_hung(outcome, ENDS_WITHIN_S)
    affected = [s for s in outcome.streams if s.outcome != "complete"]
    if name != "prefill-0":  # every stream runs through these three until its end
        assert len(affected) == IN_FLIGHT, outcome.summary()
    missing = outcome.health[503] + outcome.health[0]  # 0: the api itself was down
    assert missing > 0, f"/health never said the role was missing: {outcome.summary()}"
    if name == "api-0":  # its clients are gone: the engines stop computing for them
        wait_until(lambda: daemon.worker("tokenizer-0")["inflight"] == 0, 5, "requests dropped")
    assert_recovered(daemon, name, old_pid)


@pytest.mark.parametrize("name", ["prefill-0", "decode-0"])
def test_sigstop_under_load(daemon_short_heartbeat: Daemon, name: str) -> None:
    daemon = daemon_short_heartbeat
    old_pid = daemon.worker(name)["pid"]
    outcome = inject(daemon, name, signal.SIGSTOP)
    print(f"SIGSTOP {name}: {outcome.summary()}")
    assert_nothing_hung(outcome, HEARTBEAT_TIMEOUT_S + ENDS_WITHIN_S)
    assert f"{name} (pid {old_pid}) sent no heartbeat" in daemon.log()
    assert outcome.health[503] > 0, f"/health never said the role was missing: {outcome.summary()}"
    assert_recovered(daemon, name, old_pid)


def test_engines_drop_the_requests_of_a_dead_tokenizer(daemon: Daemon) -> None:
    """kill -9 of the tokenizer while long answers stream: its clients get their error at
    once (the api's doing), and the engines, which would compute every answer to the end
    (the session length) with their KV blocks held, drop them within a second or two."""
    pid = daemon.worker("tokenizer-0")["pid"]
    streams = [Stream() for _ in range(IN_FLIGHT)]

    def engines_idle() -> bool:
        workers = [daemon.worker(n) for n in ENGINES]
        return all(
            w["kv"]["free_blocks"] == w["kv"]["total_blocks"] and w["inflight"] == 0
            for w in workers
        )

    async def run() -> float:
        limits = httpx.Limits(max_connections=IN_FLIGHT)
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120, limits=limits) as http:
            started = [asyncio.Event() for _ in streams]
            tasks = [
                asyncio.create_task(stream_one(http, s, e, 100_000))
                for s, e in zip(streams, started, strict=True)
            ]
            async with asyncio.timeout(60):
                await asyncio.gather(*(e.wait() for e in started))
            await asyncio.to_thread(wait_until, lambda: not engines_idle(), 5, "busy engines")
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(wait_until, engines_idle, 2.5, "the engines to drop them")
            idle_after = time.monotonic() - killed_at
            async with asyncio.timeout(30):
                await asyncio.gather(*tasks)
            return idle_after

    idle_after = asyncio.run(run())
    print(f"kill -9 tokenizer-0: engines idle {idle_after:.2f} s after the kill")
    assert all(s.outcome != "complete" for s in streams)
    wait_until(
        lambda: (
            daemon.worker("tokenizer-0")["pid"] not in (None, pid)
            and daemon.worker("tokenizer-0")["state"] == "running"
        ),
        60,
        "tokenizer-0 to be replaced",
    )
    assert_recovered(daemon, "tokenizer-0", pid)
