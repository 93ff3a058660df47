"""`lmd-bench serve`'s breakdown of a run from an lmd server's /metrics."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from lmd.api.cluster_metrics import ClusterCollector
from lmd.bench.serve_stages import breakdown, lines, parse, quantile
from lmd.stage_times import StageTimes


def exposition(workers: list[dict[str, object]]) -> str:
    collector = ClusterCollector(control_socket=Path("/nonexistent"))
    collector.workers = workers
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_a_run_is_the_difference_of_two_scrapes_grouped_by_role() -> None:
    api0, api1, tok = StageTimes(), StageTimes(), StageTimes()
    api0.observe("to_api", 0.001)  # before the run
    before = parse(exposition([
        {"name": "api-0", "cpu_s": 1.0, "stages": api0.to_dict()},
        {"name": "tokenizer-0", "cpu_s": 2.0, "stages": tok.to_dict()},
    ]))  # fmt: skip
    for _ in range(3):
        api0.observe("to_api", 0.002)
        api1.observe("to_api", 0.004)
    tok.observe("detokenize", 0.0003)
    after = parse(exposition([
        {"name": "api-0", "cpu_s": 3.0, "stages": api0.to_dict()},
        {"name": "api-1", "cpu_s": 1.0, "stages": api1.to_dict()},
        {"name": "tokenizer-0", "cpu_s": 2.5, "stages": tok.to_dict()},
    ]))  # fmt: skip
    assert before is not None and after is not None
    out = breakdown(before, after, duration_s=2.0)
    rows = {(r["stage"], r["role"]): r for r in out["stages"]}
    both = rows[("to_api", "api")]  # two api workers, one row; the earlier one left out
    assert both["count"] == 6 and abs(both["mean_ms"] - 3.0) < 1e-9
    assert 1.0 <= both["p50_ms"] <= 2.5 and 2.5 <= both["p99_ms"] <= 5.0
    assert rows[("detokenize", "tokenizer")]["count"] == 1
    assert [r["stage"] for r in out["stages"]] == ["detokenize", "to_api"]  # request order
    assert out["cpu_cores"] == {"api-0": 1.0, "api-1": 0.5, "tokenizer-0": 0.25}
    text = "\n".join(lines(out))
    assert "to_api (api)" in text and "api-1 0.50" in text


def test_a_server_without_the_series_gives_nothing() -> None:
    assert parse("# HELP x y\n# TYPE x counter\nx_total 1.0\n") is None
    assert lines({}) == []


def test_quantiles_interpolate_within_a_bucket() -> None:
    cumulative = [(0.001, 0.0), (0.002, 10.0), (float("inf"), 10.0)]
    assert quantile(0.5, cumulative) == 0.0015
    assert quantile(0.5, [(0.001, 0.0)]) is None
    assert quantile(0.99, [(0.001, 0.0), (float("inf"), 4.0)]) == 0.001  # past the last bound
