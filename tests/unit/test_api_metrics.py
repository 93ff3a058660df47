"""The api's Prometheus metrics (ApiMetrics): per-request histograms and counters."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

from lmd.api.metrics import ApiMetrics, forget_process


def test_metrics_per_request() -> None:
    m = ApiMetrics()
    for _ in range(5):
        m.opened()
    m.closed()
    m.first_token(0.5)
    m.finished(e2e_s=2.5, first_token_s=0.5, num_tokens=5)  # 4 tokens after the first in 2 s
    m.tokens(10, 5)
    m.count("completions", 200)
    text = m.render().decode()
    assert "lmd_time_per_output_token_seconds_sum 0.5" in text
    assert "lmd_e2e_request_latency_seconds_sum 2.5" in text
    assert "lmd_prompt_tokens_total 10.0" in text and "lmd_generation_tokens_total 5.0" in text
    assert 'lmd_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert "lmd_requests_running 4.0" in text


def _api_process(directory: str, prompt_tokens: int, num_open: int, answer: Any) -> None:
    """One api process of a daemon: a request answered, `num_open` still running; sends
    its pid, then (as the one that answers the scrape) what /metrics would show."""
    m = ApiMetrics(Path(directory))
    m.first_token(0.02)
    m.tokens(prompt_tokens, 1)
    m.count("completions", 200)
    for _ in range(num_open):
        m.opened()
    answer.send((os.getpid(), m.render().decode()))


def _run_api(directory: Path, prompt_tokens: int, num_open: int) -> tuple[int, str]:
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_api_process, args=(str(directory), prompt_tokens, num_open, theirs))
    proc.start()
    pid, text = mine.recv()
    proc.join(30)
    return pid, text


def test_api_processes_add_up_in_a_shared_directory(tmp_path: Path) -> None:
    a, _ = _run_api(tmp_path, 10, num_open=2)
    _run_api(tmp_path, 5, num_open=1)  # ended without the supervisor noticing
    forget_process(tmp_path, a)  # the supervisor saw `a` end: its requests ended with it
    _, text = _run_api(tmp_path, 100, num_open=0)  # the one that answers the scrape
    assert "lmd_prompt_tokens_total 115.0" in text  # all three processes' counts
    assert 'lmd_requests_total{endpoint="completions",status="200"} 3.0' in text
    assert "lmd_time_to_first_token_seconds_count 3.0" in text
    assert "lmd_requests_running 1.0" in text  # a's 2 forgotten, b's 1 kept
