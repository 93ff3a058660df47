"""lmd-bench front against the real daemon it starts (hybrid mode; the fixed-token engine
and the real engine around the fake backend)."""

from __future__ import annotations

from argparse import Namespace

import pytest

from lmd.bench import front


@pytest.mark.parametrize("engine", ["fixed", "fake"])
def test_front_benchmark_serves_every_request_through_a_real_daemon(engine: str) -> None:
    args = Namespace(
        engine=engine,
        requests=40,
        concurrency=4,
        stream_tokens=8,
        port=0,
        temperature=1.0,
        torch_threads=1,
    )
    result = front.run(args)
    assert result["failed"] == 0 and result["engine"] == engine
    assert result["requests_per_s"] > 0 and result["streamed_tokens_per_s"] > 0
    assert result["latency_ms_at_concurrency_1"]["p50"] > 0
    assert 1 <= result["stream_tokens_per_write"] <= 8  # 8 tokens a stream, >= 1 write each
    # An SSE event per token, but for a token whose text ends inside a UTF-8 character:
    # it waits for the next one.
    assert 1.0 <= result["stream_tokens_per_event"] < 1.2
    processes = {"supervisor", "api-0", "tokenizer-0", "hybrid-0", "daemon", "client"}
    assert set(result["cpu_ms_per_request"]) == processes
    assert set(result["cpu_us_per_streamed_token"]) == processes
