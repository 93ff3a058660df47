"""`GET /v1/metrics` on the control socket: what `lmdctl metrics` shows.

1. Scrape every running api worker's `/metrics` (Prometheus text) on the api port.
2. Wait `interval` seconds (meanwhile read the GPUs through NVML in a thread), scrape again.
3. Rates and latency quantiles from the two scrapes (`metrics_summary.py`).
4. KV use, running and waiting per engine worker from their latest heartbeats (what
   `lmdctl status` shows), read after the window so they are at most one heartbeat old.
An api that cannot be scraped leaves `api.error` set and the rest still answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from lmd.http_server import quiet_http_client_logs
from lmd.protocol.roles import ENGINE_ROLES
from lmd.supervisor.gpu_stats import read_gpus, unavailable
from lmd.supervisor.metrics_summary import QUANTILE_METHOD, Scrape, parse, summarize

SCRAPE_TIMEOUT_S = 5.0
MAX_INTERVAL_S = 60.0


def scrape_url(host: str, port: int) -> str:
    """Where the supervisor reaches the api's /metrics: a wildcard host means loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


async def _scrape_all(client: httpx.AsyncClient, urls: list[str]) -> Scrape:
    async def one(url: str) -> Scrape:
        response = await client.get(url)
        response.raise_for_status()
        return parse(response.text)

    scrapes = await asyncio.gather(*(one(u) for u in urls))
    total = scrapes[0]
    for s in scrapes[1:]:
        total = total.plus(s)
    return total


def engine_json(worker: dict[str, Any]) -> dict[str, Any]:
    """One engine worker's load from its heartbeat (kv is None for a bare worker)."""
    kv = worker.get("kv")
    kv_json = None
    if kv and kv.get("total_blocks"):
        used = kv["total_blocks"] - kv["free_blocks"]
        kv_json = {**kv, "used_blocks": used, "usage": used / kv["total_blocks"]}
    return {
        "name": worker["name"],
        "role": worker["role"],
        "state": worker["state"],
        "running": worker.get("running"),
        "waiting": worker.get("waiting"),
        "kv": kv_json,
    }


async def collect(
    api_sources: Mapping[str, str],
    workers: Callable[[], list[dict[str, Any]]],
    interval: float,
) -> dict[str, Any]:
    """The metrics reply. `api_sources`: running api worker name -> its /metrics URL;
    `workers`: the supervisor's worker list (called after the window)."""
    if not 0 < interval <= MAX_INTERVAL_S:
        raise ValueError(f"interval must be > 0 and <= {MAX_INTERVAL_S:.0f} s, got {interval}")
    quiet_http_client_logs()
    gpu_task = asyncio.create_task(asyncio.to_thread(read_gpus))
    urls = sorted(set(api_sources.values()))
    api: dict[str, Any] = {"sources": sorted(api_sources), "error": None}
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
        try:
            if not urls:
                raise LookupError("no api worker is running")
            before = await _scrape_all(client, urls)
            t0 = time.monotonic()
            await asyncio.sleep(interval)
            after = await _scrape_all(client, urls)
            api.update(summarize(before, after, time.monotonic() - t0))
        except LookupError as exc:
            api["error"] = str(exc)
        except (httpx.HTTPError, ValueError) as exc:
            names = ", ".join(sorted(api_sources))
            api["error"] = f"could not read /metrics of {names}: {str(exc) or type(exc).__name__}"
    engines = [engine_json(w) for w in workers() if w["role"] in ENGINE_ROLES]
    return {
        "interval_s": interval,
        "quantiles": QUANTILE_METHOD,
        "api": api,
        "engines": engines,
        "running": sum(e["running"] or 0 for e in engines),
        "waiting": sum(e["waiting"] or 0 for e in engines),
        "gpu": await _gpus(gpu_task),
    }


async def _gpus(task: asyncio.Task[dict[str, Any]]) -> dict[str, Any]:
    try:
        return await task
    except Exception as exc:  # an odd pynvml build must not cost the rest of the reply
        return unavailable(f"NVML failed: {type(exc).__name__}: {exc}")
