"""`lmdctl scale` under load: decode workers added and removed while requests stream,
and not one request lost."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.daemon import DISAGGREGATED, Daemon, wait_until

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(*DISAGGREGATED, "--heartbeat-interval", "0.5", "--heartbeat-timeout", "5")
    try:
        d.start()
        yield d
    finally:
        d.close()


def lmdctl(daemon: Daemon, *args: str) -> str:
    cmd = [sys.executable, "-m", "lmd_client.lmdctl", "--socket", str(daemon.socket_path), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def names(daemon: Daemon, role: str) -> list[str]:
    return sorted(w["name"] for w in daemon.status()["workers"] if w["role"] == role)


def test_scale_decode_up_and_down_under_load_loses_nothing(daemon: Daemon) -> None:
    results: list[dict[str, Any]] = []

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": f"load {i}", "max_tokens": 300, "ignore_eos": True}
        r = await http.post("/v1/completions", json=body)
        results.append({"status": r.status_code, "body": r.json()})

    async def load(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as http:
            i = 0
            running: set[asyncio.Task[None]] = set()
            while not stop.is_set() or running:
                while not stop.is_set() and len(running) < 8:
                    task = asyncio.create_task(one(http, i))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    i += 1
                await asyncio.sleep(0.05)

    def received(name: str) -> int:
        got: int = daemon.worker(name).get("migration", {}).get("received", 0)
        return got

    async def scenario() -> None:
        stop = asyncio.Event()
        traffic = asyncio.create_task(load(stop))
        await asyncio.sleep(1.0)
        out = await asyncio.to_thread(lmdctl, daemon, "scale", "decode", "2")
        assert "starting decode-1" in out
        await asyncio.to_thread(
            wait_until, lambda: received("decode-1") > 3, 60, "decode-1 taking requests"
        )
        out = await asyncio.to_thread(lmdctl, daemon, "scale", "decode", "1")
        assert "retiring decode-1" in out
        await asyncio.to_thread(
            wait_until, lambda: names(daemon, "decode") == ["decode-0"], 60, "decode-1 gone"
        )
        await asyncio.sleep(1.0)  # traffic goes on with decode-0 alone
        stop.set()
        await traffic

    asyncio.run(scenario())
    assert len(results) > 20
    for r in results:
        assert r["status"] == 200, r
        assert r["body"]["usage"]["completion_tokens"] == 300
    assert daemon.worker("decode-0")["restarts"] == 0
    wait_until(
        lambda: all(
            daemon.worker(n)["kv"]["free_blocks"] == daemon.worker(n)["kv"]["total_blocks"]
            for n in ("prefill-0", "decode-0")
        ),
        10,
        "every KV block free",
    )


def test_scale_errors_are_one_line(daemon: Daemon) -> None:
    cmd = [sys.executable, "-m", "lmd_client.lmdctl", "--socket", str(daemon.socket_path)]
    bad = subprocess.run(
        [*cmd, "scale", "decode", "0"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 1 and "out of range" in bad.stderr
    assert bad.stderr.count("\n") == 1
    wrong = subprocess.run([*cmd, "scale", "api", "2"], capture_output=True, text=True, check=False)
    assert wrong.returncode == 2  # argparse: not a scalable role
