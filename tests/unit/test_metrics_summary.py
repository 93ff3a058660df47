"""lmdctl metrics' arithmetic: bucket quantiles, window rates and restarts, against values
worked out by hand from the api's real /metrics text (api_metrics.ApiMetrics)."""

from __future__ import annotations

import pytest

from lmd.api.metrics import ApiMetrics
from lmd.supervisor.metrics_collect import engine_json, scrape_url
from lmd.supervisor.metrics_summary import Histogram, Scrape, bucket_quantile, parse, summarize

INF = float("inf")


def scrape_of(metrics: ApiMetrics) -> Scrape:
    return parse(metrics.render().decode())


def test_quantile_interpolates_inside_the_bucket_that_holds_the_rank() -> None:
    # TTFTs 0.02, 0.03, 0.04, 0.2 s in the api's buckets ... 0.025, 0.05, 0.1, 0.25 ...
    bounds = (0.01, 0.025, 0.05, 0.1, 0.25, INF)
    cumulative = (0.0, 1.0, 3.0, 3.0, 4.0, 4.0)
    # p50: rank 2 lies in (0.025, 0.05] holding ranks 1..3: 0.025 + 0.025 * (2 - 1) / 2
    assert bucket_quantile(0.5, bounds, cumulative) == pytest.approx(0.0375)
    # p99: rank 3.96 lies in (0.1, 0.25] holding ranks 3..4: 0.1 + 0.15 * 0.96
    assert bucket_quantile(0.99, bounds, cumulative) == pytest.approx(0.244)


def test_quantile_edges() -> None:
    # The first bucket starts at 0: one 5 ms observation in (0, 0.01] -> p50 = 0.005.
    assert bucket_quantile(0.5, (0.01, INF), (1.0, 1.0)) == pytest.approx(0.005)
    # A rank in +Inf answers the highest finite bound (nothing finer is known).
    assert bucket_quantile(0.99, (0.01, 80.0, INF), (0.0, 0.0, 1.0)) == 80.0
    assert bucket_quantile(0.5, (0.01, INF), (0.0, 0.0)) is None  # nothing observed
    with pytest.raises(ValueError, match="quantile"):
        bucket_quantile(1.5, (0.01, INF), (1.0, 1.0))


def running(num_open: int) -> ApiMetrics:
    """An api's series with `num_open` requests running."""
    m = ApiMetrics()
    for _ in range(num_open):
        m.opened()
    return m


def test_parse_reads_the_api_series() -> None:
    m = running(3)
    for seconds in (0.02, 0.03, 0.04, 0.2):
        m.first_token(seconds)
    m.finished(e2e_s=0.5, first_token_s=0.03, num_tokens=101)  # TPOT 0.47 / 100 = 0.0047
    m.tokens(prompt_tokens=12, completion_tokens=101)
    m.count("chat", 200)
    m.count("completions", 200)
    m.count("chat", 499)
    s = scrape_of(m)
    assert s.histograms["ttft"].count == 4
    assert s.histograms["ttft"].sum == pytest.approx(0.29)
    ttft = s.histograms["ttft"].to_json()
    assert ttft["count"] == 4
    assert ttft["mean_s"] == pytest.approx(0.0725)
    assert ttft["p50_s"] == pytest.approx(0.0375)
    assert ttft["p99_s"] == pytest.approx(0.244)
    # TPOT 0.0047 s in (0.0025, 0.005]: p50 = 0.0025 + 0.0025 * 0.5 / 1
    assert s.histograms["tpot"].quantile(0.5) == pytest.approx(0.00375)
    assert s.histograms["e2e"].to_json()["mean_s"] == pytest.approx(0.5)  # the mean is exact
    assert (s.prompt_tokens, s.generation_tokens, s.running) == (12, 101, 3)
    assert s.requests == {"200": 2.0, "499": 1.0}  # summed over endpoints


def test_window_rates_and_latencies_count_only_the_window() -> None:
    m = running(0)
    m.first_token(3.0)  # before the window: in since_start, not in the window
    m.tokens(prompt_tokens=100, completion_tokens=10)
    m.count("chat", 200)
    before = scrape_of(m)
    for ttft in (0.02, 0.03, 0.04, 0.2):
        m.first_token(ttft)
    m.tokens(prompt_tokens=40, completion_tokens=30)
    for status in (200, 200, 200, 499):
        m.count("chat", status)
    after = scrape_of(m)

    out = summarize(before, after, seconds=2.0)
    win, total = out["window"], out["since_start"]
    assert win["generation_tokens_per_s"] == 15.0  # 30 tokens / 2 s
    assert win["prompt_tokens_per_s"] == 20.0
    assert win["requests_per_s"] == 2.0  # 4 requests / 2 s
    assert win["requests"] == {"200": 3, "499": 1}
    assert win["restarted"] is False
    assert win["ttft"]["count"] == 4
    assert win["ttft"]["p50_s"] == pytest.approx(0.0375)
    assert win["ttft"]["p99_s"] == pytest.approx(0.244)
    assert win["e2e"] == {"count": 0, "mean_s": None, "p50_s": None, "p99_s": None}
    assert total["generation_tokens"] == 40 and total["requests"] == {"200": 4, "499": 1}
    # Since start, 3.0 s joins the four: rank 2.5 of 5 in (0.025, 0.05] holding 1..3
    assert total["ttft"]["count"] == 5
    assert total["ttft"]["p50_s"] == pytest.approx(0.025 + 0.025 * 1.5 / 2)


def test_an_api_restart_between_scrapes_counts_from_the_restart() -> None:
    old = running(0)
    old.tokens(prompt_tokens=500, completion_tokens=500)
    old.count("chat", 200)
    new = running(0)  # the restarted api: counters from zero
    new.tokens(prompt_tokens=8, completion_tokens=6)
    new.count("chat", 200)
    out = summarize(scrape_of(old), scrape_of(new), seconds=2.0)
    assert out["window"]["restarted"] is True
    assert out["window"]["generation_tokens_per_s"] == 3.0  # 6 / 2, not (6 - 500) / 2
    assert out["window"]["requests"] == {"200": 1}


def test_a_changed_created_time_is_a_restart_even_when_counts_grew() -> None:
    h = Histogram((1.0, INF), (0.0, 0.0), 0.0)
    hists = {"ttft": h, "tpot": h, "e2e": h}
    before = Scrape(hists, generation_tokens=5, created=(100.0, 100.0, 100.0))
    after = Scrape(hists, generation_tokens=9, created=(200.0, 200.0, 200.0))
    assert after.restarted_since(before)
    assert after.minus(before).generation_tokens == 9


def test_two_api_workers_add_up() -> None:
    a, b = running(1), running(2)
    a.first_token(0.02)
    b.first_token(0.2)
    a.tokens(1, 10)
    b.tokens(2, 20)
    both = scrape_of(a).plus(scrape_of(b))
    assert (both.generation_tokens, both.prompt_tokens, both.running) == (30, 3, 3)
    assert both.histograms["ttft"].count == 2
    # ranks: 1 in (0.01, 0.025], 2 in (0.1, 0.25]; p50 rank 1 -> top of the first
    assert both.histograms["ttft"].quantile(0.5) == pytest.approx(0.025)


def test_parse_names_a_missing_series_and_a_window_needs_time() -> None:
    with pytest.raises(ValueError, match="lmd_time_to_first_token_seconds"):
        parse("# nothing here\n")
    s = scrape_of(running(0))
    with pytest.raises(ValueError, match="> 0 s"):
        summarize(s, s, 0.0)


def test_engine_kv_use_from_the_heartbeat() -> None:
    worker = {
        "name": "hybrid-0",
        "role": "hybrid",
        "state": "running",
        "running": 3,
        "waiting": 1,
        "kv": {"total_blocks": 200, "free_blocks": 150, "block_size": 64},
    }
    e = engine_json(worker)
    assert e["kv"]["used_blocks"] == 50 and e["kv"]["usage"] == 0.25
    assert (e["running"], e["waiting"]) == (3, 1)
    bare = engine_json({"name": "decode-0", "role": "decode", "state": "running"})
    assert bare["kv"] is None and bare["running"] is None


def test_scrape_url_reaches_a_wildcard_listener_on_loopback() -> None:
    assert scrape_url("0.0.0.0", 23333) == "http://127.0.0.1:23333/metrics"
    assert scrape_url("::", 80) == "http://[::1]:80/metrics"
    assert scrape_url("10.0.0.5", 8000) == "http://10.0.0.5:8000/metrics"
