"""The engines' series on /metrics, from status entries as heartbeats carry them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lmd.api.cluster_metrics import ClusterCollector
from lmd.migration.stats import SECONDS_BUCKETS, MigrationStats
from lmd.stage_times import StageTimes


def samples(
    workers: list[dict[str, Any]], labels: tuple[str, ...] = ("worker", "le")
) -> dict[tuple[str, ...], float]:
    """Every sample by (name, *its values of `labels`)."""
    collector = ClusterCollector(control_socket=Path("/nonexistent"))
    collector.workers = workers
    registry = CollectorRegistry()
    registry.register(collector)
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, *(s.labels.get(label, "") for label in labels))] = s.value
    return out


def test_kv_queues_and_migration_per_worker() -> None:
    stats = MigrationStats()
    stats.record(3_000_000, 0.0004)  # lands in the 0.0005 bucket
    stats.record(1_000_000, 0.003)  # the 0.005 bucket
    stats.failures = 2
    workers = [
        {"name": "tokenizer-0", "running": 4},
        {
            "name": "prefill-0",
            "kv": {"total_blocks": 100, "free_blocks": 75},
            "running": 2,
            "waiting": 1,
            "migration": stats.to_dict(),
        },
        {"name": "decode-0", "kv": {"total_blocks": 50, "free_blocks": 50}, "running": 0},
    ]
    got = samples(workers)
    assert got[("lmd_kv_blocks_total", "prefill-0", "")] == 100
    assert got[("lmd_kv_usage_ratio", "prefill-0", "")] == 0.25
    assert got[("lmd_kv_usage_ratio", "decode-0", "")] == 0.0
    assert got[("lmd_engine_waiting", "prefill-0", "")] == 1
    assert ("lmd_engine_running", "tokenizer-0", "") not in got  # not an engine
    assert got[("lmd_migration_bytes_total", "prefill-0", "")] == 4_000_000
    assert got[("lmd_migration_failures_total", "prefill-0", "")] == 2
    assert got[("lmd_migration_seconds_count", "prefill-0", "")] == 2
    assert abs(got[("lmd_migration_seconds_sum", "prefill-0", "")] - 0.0034) < 1e-12
    assert got[("lmd_migration_seconds_bucket", "prefill-0", "0.00025")] == 0
    assert got[("lmd_migration_seconds_bucket", "prefill-0", "0.0005")] == 1
    assert got[("lmd_migration_seconds_bucket", "prefill-0", "0.005")] == 2
    assert got[("lmd_migration_seconds_bucket", "prefill-0", "+Inf")] == 2
    assert len(stats.seconds_counts) == len(SECONDS_BUCKETS) + 1
    assert ("lmd_migration_bytes_total", "decode-0", "") not in got


async def test_no_supervisor_means_no_engine_series() -> None:
    collector = ClusterCollector(control_socket=Path("/nonexistent"))
    collector.workers = [{"name": "x"}]
    await collector.refresh()  # nothing listens there: no figures, no exception
    assert collector.workers == []


def test_every_worker_s_stages_and_cpu() -> None:
    times = StageTimes()
    times.observe("to_tokenizer", 0.0003)
    times.observe("to_tokenizer", 0.002)
    workers = [
        {"name": "tokenizer-0", "cpu_s": 12.5, "stages": times.to_dict()},
        {"name": "api-0", "cpu_s": 3.0, "stages": {"bad": {"buckets": [1]}}},  # skipped
    ]
    got = samples(workers, ("stage", "worker", "le"))
    assert got[("lmd_worker_cpu_seconds_total", "", "tokenizer-0", "")] == 12.5
    assert got[("lmd_worker_cpu_seconds_total", "", "api-0", "")] == 3.0
    stage = ("to_tokenizer", "tokenizer-0")
    assert got[("lmd_stage_seconds_count", *stage, "")] == 2
    assert got[("lmd_stage_seconds_bucket", *stage, "0.0005")] == 1
    assert got[("lmd_stage_seconds_bucket", *stage, "0.0025")] == 2
    assert got[("lmd_stage_seconds_bucket", *stage, "+Inf")] == 2
    assert not any(k[1] == "bad" for k in got)
