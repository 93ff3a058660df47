"""The engines' series on the api's /metrics: KV use, running and waiting requests, and
KV migration, per worker, from the supervisor's status.

Engine workers report these numbers in their heartbeats, which reach the supervisor; at
each scrape the api reads the supervisor's `/v1/status` over the control socket (one
short local request, with a timeout) and exposes the latest figures. Series:
  lmd_kv_blocks_total{worker}, lmd_kv_blocks_free{worker}, lmd_kv_usage_ratio{worker},
  lmd_engine_running{worker}, lmd_engine_waiting{worker}             (every engine)
  lmd_migration_bytes_total{worker}, lmd_migration_seconds{worker} (histogram),
  lmd_migration_failures_total{worker}                              (prefill workers)
  lmd_stage_seconds{stage, worker} (histogram; stage_times.py),
  lmd_worker_cpu_seconds_total{worker}                              (every worker)
Counters restart from zero with their worker's process, as Prometheus expects. When
the supervisor does not answer, the scrape still succeeds without these series.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from lmd.http_server import quiet_http_client_logs
from lmd.stage_times import BUCKETS

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 1.0


class ClusterCollector(Collector):
    def __init__(self, control_socket: Path) -> None:
        quiet_http_client_logs()
        self.control_socket = control_socket
        self.workers: list[dict[str, Any]] = []

    async def refresh(self) -> None:
        """Fetch the workers' latest heartbeat figures; keep none if that fails."""
        transport = httpx.AsyncHTTPTransport(uds=str(self.control_socket))
        try:
            async with httpx.AsyncClient(
                transport=transport, base_url="http://lmd", timeout=STATUS_TIMEOUT_S
            ) as http:
                response = await http.get("/v1/status")
                response.raise_for_status()
                workers = response.json().get("workers", [])
        except (httpx.HTTPError, OSError, ValueError) as exc:
            log.debug("no engine figures for /metrics: %s", exc)
            workers = []
        self.workers = [w for w in workers if isinstance(w, dict) and "name" in w]

    def collect(self) -> Iterator[Metric]:
        return iter(engine_metrics(self.workers))


def engine_metrics(workers: list[dict[str, Any]]) -> list[Metric]:
    """Metric families for the engine and migration figures of `workers` (status entries)."""
    gauges = {
        "total": GaugeMetricFamily("lmd_kv_blocks_total", "KV cache blocks.", labels=["worker"]),
        "free": GaugeMetricFamily(
            "lmd_kv_blocks_free", "KV cache blocks free (cached ones count).", labels=["worker"]
        ),
        "usage": GaugeMetricFamily(
            "lmd_kv_usage_ratio", "Share of KV cache blocks in use.", labels=["worker"]
        ),
        "running": GaugeMetricFamily(
            "lmd_engine_running", "Sequences an engine is computing.", labels=["worker"]
        ),
        "waiting": GaugeMetricFamily(
            "lmd_engine_waiting", "Sequences waiting for an engine.", labels=["worker"]
        ),
    }
    moved = CounterMetricFamily(
        "lmd_migration_bytes", "KV bytes migrated to decode workers.", labels=["worker"]
    )
    failures = CounterMetricFamily(
        "lmd_migration_failures",
        "Requests whose KV migration was refused, failed or timed out.",
        labels=["worker"],
    )
    seconds = HistogramMetricFamily(
        "lmd_migration_seconds", "Seconds per request's KV copy.", labels=["worker"]
    )
    for w in workers:
        name = str(w["name"])
        kv = w.get("kv")
        if isinstance(kv, dict) and kv.get("total_blocks"):
            total, free = int(kv["total_blocks"]), int(kv["free_blocks"])
            gauges["total"].add_metric([name], total)
            gauges["free"].add_metric([name], free)
            gauges["usage"].add_metric([name], (total - free) / total)
            gauges["running"].add_metric([name], int(w.get("running", 0)))
            gauges["waiting"].add_metric([name], int(w.get("waiting", 0)))
        mig = w.get("migration")
        if isinstance(mig, dict) and "seconds_counts" in mig:
            moved.add_metric([name], int(mig["bytes"]))
            failures.add_metric([name], int(mig["failures"]))
            bounds = [*mig["seconds_buckets"], float("inf")]
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, mig["seconds_counts"], strict=True):
                cumulative += int(count)
                buckets.append((_le(bound), cumulative))
            seconds.add_metric([name], buckets, float(mig["seconds_sum"]))
    return [*gauges.values(), moved, failures, seconds, *worker_metrics(workers)]


def worker_metrics(workers: list[dict[str, Any]]) -> list[Metric]:
    """Every worker's stage histograms and CPU time (what a stage costs, and which
    process is saturated)."""
    stages = HistogramMetricFamily(
        "lmd_stage_seconds",
        "Seconds per stage of a request's way through the workers (see stage_times.py).",
        labels=["stage", "worker"],
    )
    cpu = CounterMetricFamily(
        "lmd_worker_cpu_seconds", "CPU seconds a worker process used.", labels=["worker"]
    )
    bounds = [_le(b) for b in (*BUCKETS, float("inf"))]
    for w in workers:
        name = str(w["name"])
        if isinstance(w.get("cpu_s"), int | float):
            cpu.add_metric([name], float(w["cpu_s"]))
        observed = w.get("stages")
        if not isinstance(observed, dict):
            continue
        for stage, h in observed.items():
            counts = h.get("buckets") if isinstance(h, dict) else None
            if not isinstance(counts, list) or len(counts) != len(bounds):
                continue
            cumulative = list(itertools.accumulate(int(c) for c in counts))
            stages.add_metric([str(stage), name], list(zip(bounds, cumulative, strict=True)),
                              float(h.get("sum_s", 0.0)))  # fmt: skip
    return [stages, cpu]


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
