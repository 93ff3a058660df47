"""The figures `lmd-bench serve` derives from per-request records."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lmd.bench.serve_metrics import RequestResult, parse_slos, percentile, stats_ms, summarize


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        values = [rng.random() for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_stats_are_milliseconds_and_none_when_empty() -> None:
    assert stats_ms([0.001, 0.003]) == {"mean": 2.0, "p50": 2.0, "p90": 2.8, "p99": 2.98}
    assert stats_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_one_request_by_hand() -> None:
    r = RequestResult(start=10.0, expected_input_len=4, chunk_times=[10.2, 10.25, 10.4],
                      end=10.4, prompt_tokens=6, completion_tokens=5)  # fmt: skip
    assert r.ttft == pytest.approx(0.2) and r.e2e == pytest.approx(0.4)
    assert r.tpot == pytest.approx(0.05)  # (0.4 - 0.2) / (5 - 1)
    assert r.itls == pytest.approx([0.05, 0.15])
    assert (r.input_tokens, r.output_tokens) == (6, 5)
    single = RequestResult(start=0, expected_input_len=4, chunk_times=[0.1], end=0.1)
    assert single.tpot is None and single.output_tokens == 1 and single.input_tokens == 4
    silent = RequestResult(start=0, expected_input_len=4, end=0.3, completion_tokens=0)
    assert silent.ttft is None and silent.tpot is None


def test_a_request_without_text_uses_its_e2e_as_ttft_for_goodput() -> None:
    silent = RequestResult(start=0, expected_input_len=1, end=0.3, completion_tokens=0)
    assert summarize([silent], 1.0, {"ttft": 299})["good_requests"] == 0
    assert summarize([silent], 1.0, {"ttft": 300})["good_requests"] == 1
    assert summarize([silent], 1.0)["ttft_ms"]["mean"] is None  # not a first token


def test_parse_slos() -> None:
    assert parse_slos(["ttft:500", "tpot:12.5", "e2e:10000"]) == {
        "ttft": 500.0, "tpot": 12.5, "e2e": 10000.0,
    }  # fmt: skip
    for bad in ("ttfb:1", "ttft", "ttft:x", "ttft:0", "ttft:-3"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_slos([bad])


def test_nothing_completed() -> None:
    failed = RequestResult(start=0, expected_input_len=1, end=1, error="timeout",
                           error_message="no answer")  # fmt: skip
    out = summarize([failed, failed], 0.0)
    assert (out["completed"], out["failed"], out["failed_kinds"]) == (0, 2, {"timeout": 2})
    assert out["request_throughput"] == out["output_throughput"] == 0
    assert out["failed_examples"] == {"timeout": "no answer"}
