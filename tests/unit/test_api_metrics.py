"""The api's Prometheus metrics (ApiMetrics): per-request histograms and counters."""

from __future__ import annotations

from lmd.api.metrics import ApiMetrics


def test_metrics_per_request() -> None:
    m = ApiMetrics(lambda: 4)
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
