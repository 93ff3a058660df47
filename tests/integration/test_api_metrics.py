"""/metrics on the api worker (api_stack.py): request counts, tokens and latencies."""

from __future__ import annotations

from tests.integration.api_stack import MODEL, Stack, chat_body


async def test_metrics(stack: Stack) -> None:
    await stack.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 3}
    )
    await stack.http.post("/v1/chat/completions", json=chat_body(temperature=-1))
    text = (await stack.http.get("/metrics")).text
    assert 'lmd_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert 'lmd_requests_total{endpoint="chat_completions",status="400"} 1.0' in text
    assert "lmd_prompt_tokens_total 2.0" in text
    assert "lmd_generation_tokens_total 3.0" in text
    assert "lmd_time_to_first_token_seconds_count 1.0" in text
    assert "lmd_time_per_output_token_seconds_count 1.0" in text
    assert "lmd_e2e_request_latency_seconds_count 1.0" in text
    assert "lmd_requests_running 0.0" in text
