"""`lmdctl metrics` as text: the numbers of a /v1/metrics reply where a reader looks."""

from __future__ import annotations

from typing import Any

import pytest

from lmd_client.lmdctl import main
from lmd_client.metrics_view import metrics_text

GIB = 1 << 30


def latency(count: int, p50: float | None, p99: float | None, mean: float | None) -> dict[str, Any]:
    return {"count": count, "p50_s": p50, "p99_s": p99, "mean_s": mean}


def reply(gpu: dict[str, Any]) -> dict[str, Any]:
    return {
        "state": "running",
        "model": "SmolLM2-135M-Instruct",
        "interval_s": 2.0,
        "api": {
            "sources": ["api-0"],
            "error": None,
            "window": {
                "seconds": 2.004,
                "generation_tokens_per_s": 812.34,
                "prompt_tokens_per_s": 40.0,
                "requests_per_s": 3.5,
                "requests": {"200": 6, "499": 1},
                "restarted": False,
                "ttft": latency(7, 0.0123, 0.045, 0.02),
                "tpot": latency(6, 0.0042, 0.0245, 0.005),
                "e2e": latency(6, 0.2125, 1.5, 0.3),
            },
            "since_start": {
                "generation_tokens": 12345,
                "prompt_tokens": 678,
                "requests": {"200": 120, "499": 2},
                "ttft": latency(122, 0.01, 0.229, 0.029),
                "tpot": latency(120, 0.0036, 0.0243, 0.0051),
                "e2e": latency(120, 0.1375, 0.93, None),
            },
            "requests_running": 3,
        },
        "engines": [
            {
                "name": "hybrid-0",
                "role": "hybrid",
                "state": "running",
                "running": 3,
                "waiting": 1,
                "kv": {"total_blocks": 200, "free_blocks": 150, "used_blocks": 50, "usage": 0.25},
            },
            {
                "name": "decode-0",
                "role": "decode",
                "state": "restarting",
                "running": None,
                "waiting": None,
                "kv": None,
            },
        ],
        "running": 3,
        "waiting": 1,
        "gpu": gpu,
    }


def row(text: str, first: str) -> list[str]:
    """The cells of the line that starts with `first` (cells are 2+ spaces apart)."""
    line = next(line for line in text.splitlines() if line.startswith(first))
    return [cell.strip() for cell in line.split("  ") if cell.strip()]


def test_throughput_latency_and_engines() -> None:
    text = metrics_text(reply({"available": False, "reason": "no GPU (NVML: x)", "devices": []}))
    assert text.splitlines()[0].startswith("lmdd running   model SmolLM2-135M-Instruct")
    assert row(text, "THROUGHPUT") == ["THROUGHPUT", "LAST 2.0s", "SINCE START"]
    assert row(text, "generation") == ["generation", "812.3 tok/s", "12345 tok"]
    assert row(text, "requests") == ["requests", "3.5 req/s", "122"]
    assert row(text, "  by status") == ["by status", "200: 6, 499: 1", "200: 120, 499: 2"]
    assert row(text, "TTFT") == [
        "TTFT",
        "7",
        "12.3ms",
        "45.0ms",
        "122",
        "10.0ms",
        "229.0ms",
        "29.0ms",
    ]
    assert row(text, "E2E")[3] == "1.50s" and row(text, "E2E")[-1] == "-"
    assert "estimates from the /metrics histogram buckets" in text
    assert row(text, "hybrid-0") == ["hybrid-0", "running", "3", "1", "50/200", "25.0%"]
    assert row(text, "decode-0") == ["decode-0", "restarting", "-", "-", "-", "-"]
    assert "GPU: none: no GPU (NVML: x)" in text


def test_gpu_table() -> None:
    device = {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "memory_used_bytes": 20 * GIB,
        "memory_total_bytes": 80 * GIB,
        "utilization_percent": 45,
    }
    text = metrics_text(reply({"available": True, "reason": None, "devices": [device]}))
    assert row(text, "GPU") == ["GPU", "NAME", "MEMORY USED", "MEM %", "UTIL"]
    assert row(text, "0 ") == ["0", "NVIDIA H100 80GB HBM3", "20.0GiB / 80.0GiB", "25%", "45%"]


def test_an_unreadable_api_still_shows_engines_and_gpu() -> None:
    m = reply({"available": False, "reason": "pynvml not installed", "devices": []})
    m["api"] = {"sources": [], "error": "no api worker is running"}
    text = metrics_text(m)
    assert "api: no api worker is running" in text
    assert "THROUGHPUT" not in text
    assert row(text, "hybrid-0")[4] == "50/200"
    assert "GPU: none: pynvml not installed" in text


@pytest.mark.parametrize("interval", ["0", "61", "-1", "soon"])
def test_interval_out_of_range_is_bad_usage(
    interval: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["metrics", "--interval", interval])
    assert exc.value.code == 2
    assert "--interval" in capsys.readouterr().err
