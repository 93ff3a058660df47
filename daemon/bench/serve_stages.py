"""Where a served run's time went, from an lmd server's own `/metrics` (stage_times.py).

`lmd-bench serve` scrapes `/metrics` before and after the measured requests; the
difference of `lmd_stage_seconds{stage, worker}` gives each stage's count, mean and
quantiles over the run, grouped by role (all api workers together, all tokenizers, ...),
and the difference of `lmd_worker_cpu_seconds_total` each worker's cores busy over the
run: a process near 1.0 is the one the run waited on. Workers report in heartbeats (one
a second by default), so each scrape waits SETTLE_S first. A server without these
series (not lmd) gives no breakdown.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lmd.names import role_of
from lmd.stage_times import STAGES

SETTLE_S = 1.5  # a heartbeat interval (1 s by default) and some room


@dataclass(slots=True)
class Snapshot:
    """One scrape: per (stage, worker) the cumulative buckets {le: count} and the sum;
    per worker its CPU seconds."""

    buckets: dict[tuple[str, str], dict[float, float]] = field(default_factory=dict)
    sums: dict[tuple[str, str], float] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)


def parse(text: str) -> Snapshot | None:
    """The stage and CPU series of a /metrics exposition; None when it has none."""
    snap = Snapshot()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            worker = s.labels.get("worker", "")
            if s.name == "lmd_stage_seconds_bucket":
                key = (s.labels["stage"], worker)
                snap.buckets.setdefault(key, {})[float(s.labels["le"])] = s.value
            elif s.name == "lmd_stage_seconds_sum":
                snap.sums[(s.labels["stage"], worker)] = s.value
            elif s.name == "lmd_worker_cpu_seconds_total":
                snap.cpu_s[worker] = s.value
    return snap if snap.cpu_s or snap.buckets else None


async def scrape(client: httpx.AsyncClient, headers: dict[str, str]) -> Snapshot | None:
    """/metrics once the workers' next heartbeats are in; None (at once) if not lmd's."""
    if await _read(client, headers) is None:
        return None
    await asyncio.sleep(SETTLE_S)
    return await _read(client, headers)


async def _read(client: httpx.AsyncClient, headers: dict[str, str]) -> Snapshot | None:
    try:
        r = await client.get("/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        return parse(r.text)
    except (ValueError, KeyError):
        return None


def quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds rank q."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound  # past the last finite bound: its value
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def breakdown(before: Snapshot, after: Snapshot, duration_s: float) -> dict[str, Any]:
    """The run's stages by role (count, mean, p50, p99 in ms) and each worker's cores."""
    merged: dict[tuple[str, str], dict[float, float]] = {}
    sums: dict[tuple[str, str], float] = {}
    for (stage, worker), buckets in after.buckets.items():
        old = before.buckets.get((stage, worker), {})
        key = (stage, role_of(worker))
        into = merged.setdefault(key, {})
        for le, count in buckets.items():
            into[le] = into.get(le, 0.0) + count - old.get(le, 0.0)
        done = after.sums.get((stage, worker), 0.0) - before.sums.get((stage, worker), 0.0)
        sums[key] = sums.get(key, 0.0) + done
    order = {stage: i for i, stage in enumerate(STAGES)}
    rows = []
    for (stage, role), buckets in sorted(merged.items(), key=lambda kv: order.get(kv[0][0], 99)):
        cumulative = sorted(buckets.items())
        count = cumulative[-1][1] if cumulative else 0.0
        if count <= 0:
            continue
        p50, p99 = quantile(0.5, cumulative), quantile(0.99, cumulative)
        rows.append({
            "stage": stage, "role": role, "count": int(count),
            "mean_ms": 1e3 * sums[(stage, role)] / count,
            "p50_ms": None if p50 is None else 1e3 * p50,
            "p99_ms": None if p99 is None else 1e3 * p99,
        })  # fmt: skip
    cores = {
        worker: (seconds - before.cpu_s.get(worker, 0.0)) / duration_s
        for worker, seconds in sorted(after.cpu_s.items())
        if duration_s > 0
    }
    return {"stages": rows, "cpu_cores": cores}


def lines(result: dict[str, Any]) -> list[str]:
    """The breakdown as summary lines (nothing when the server gave none)."""
    if not result:
        return []
    out = [f"{'stage (role)':<26}" + "".join(f"{h:>12}" for h in ("count", "mean", "p50", "p99"))]
    for row in result["stages"]:
        name = f"{row['stage']} ({row['role']})"
        cells = [f"{row['count']:>12,}"] + [
            f"{'-' if row[k] is None else format(row[k], ',.2f'):>12}"
            for k in ("mean_ms", "p50_ms", "p99_ms")
        ]
        out.append(f"{name:<26}" + "".join(cells))
    # Steps of 31 ms all in the 25-50 ms bucket read as a p50 of ~38 ms (2026-11-29).
    out.append("(p50, p99: linear inside /metrics' buckets, 1-2.5-5 a decade; means are exact)")
    cores = ", ".join(f"{w} {c:.2f}" for w, c in result["cpu_cores"].items())
    if cores:
        out.append(f"{'CPU cores busy':<26}{cores}")
    return out
