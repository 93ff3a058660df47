"""Disaggregated serving with KV migrating over NIXL (`lmdd serve --migration-transport
nixl`), UCX choosing its transports as in production (no UCX_TLS):

- greedy and seeded SmolLM2 outputs equal the hybrid engine's, token for token, with
  every migration counted and no KV block left held;
- kill -9 of the decode worker during migrations: the affected requests end with an
  error, prefill opens the new decode worker's pool (a new NIXL agent) and serves on.
Skipped where NIXL is not installed (`pip install lmd[cluster]`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import httpx
import pytest

from lmd.migration import nixl
from tests.integration.daemon import DISAGGREGATED, Daemon, wait_until
from tests.integration.test_migration import (
    ENGINE,
    MODEL,
    PROMPTS,
    _stream,
    idle_and_leak_free,
    outputs,
)

pytestmark = pytest.mark.skipif(
    not nixl.available(), reason="NIXL is not installed (pip install lmd[cluster])"
)
NIXL = ("--migration-transport", "nixl")


@pytest.mark.timeout(600)
def test_nixl_disaggregated_equals_hybrid_token_for_token() -> None:
    results = {}
    for mode, extra in (("hybrid", ()), ("disaggregated", NIXL)):
        daemon = Daemon("--mode", mode, *ENGINE, *extra)
        try:
            daemon.start()
            results[mode] = outputs(daemon)
            if mode == "disaggregated":
                idle_and_leak_free(daemon, ["prefill-0", "decode-0"])
                prefill, decode = daemon.worker("prefill-0"), daemon.worker("decode-0")
                assert prefill["transport"] == decode["transport"] == "nixl"
                total = 2 * len(PROMPTS)
                migrated = (prefill["migration"]["count"], decode["migration"]["received"])
                assert migrated == (total, total)
                assert prefill["migration"]["bytes"] > 0
                assert prefill["migration"]["failures"] == 0
        finally:
            daemon.close()
    assert results["disaggregated"] == results["hybrid"]


def test_kill_decode_during_nixl_migrations() -> None:
    daemon = Daemon(*DISAGGREGATED, *NIXL, "--block-size", "16", "--heartbeat-timeout", "5")
    try:
        daemon.start()
        decode_pid = daemon.worker("decode-0")["pid"]
        prefill_pid = daemon.worker("prefill-0")["pid"]

        async def run() -> tuple[list[dict[str, Any]], float]:
            async with httpx.AsyncClient(base_url=daemon.url, timeout=60) as http:
                tasks = [
                    asyncio.create_task(_stream(http, f"request {i} " * (5 + i), 100_000))
                    for i in range(16)
                ]

                def migrated() -> bool:
                    stats = daemon.worker("decode-0").get("migration", {})
                    return int(stats.get("received", 0)) > 0

                await asyncio.to_thread(wait_until, migrated, 20, "a first migration")
                await asyncio.sleep(0.2)
                killed_at = time.monotonic()
                os.kill(decode_pid, signal.SIGKILL)
                return await asyncio.gather(*tasks), killed_at

        results, killed_at = asyncio.run(run())
        for r in results:
            assert r["ended"] in ("error", "http 503"), r
            assert r["at"] - killed_at < 10
        wait_until(lambda: daemon.worker("decode-0")["state"] == "running", 30, "decode back")
        wait_until(lambda: httpx.get(f"{daemon.url}/health").status_code == 200, 30, "health")
        for i in range(3):  # through the new decode worker's pool
            again = httpx.post(
                f"{daemon.url}/v1/completions",
                json={"model": MODEL, "prompt": f"after {i} " * 30, "max_tokens": 5},
                timeout=30,
            )
            assert again.status_code == 200, again.text
            assert again.json()["usage"]["completion_tokens"] == 5
        assert daemon.worker("prefill-0")["pid"] == prefill_pid  # prefill never restarted
        idle_and_leak_free(daemon, ["prefill-0", "decode-0"])
    finally:
        daemon.close()
