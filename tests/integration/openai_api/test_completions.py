"""Answers from /v1/chat/completions and /v1/completions: whole and streamed, sync and
async, with stop strings, logprobs and token-id prompts; a client that goes away frees
everything; /metrics counts what they served."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from lmd.engine.model_source import resolve_model
from tests.integration.daemon import Daemon, wait_until
from tests.integration.openai_api.shared_daemon import MODEL, QUESTION, async_client, idle


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_capital_of_france(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    answer = r.choices[0].message.content
    assert answer and "Paris" in answer
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.completion_tokens <= 32
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    # Streamed and non-streamed greedy answers are the same text.
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert r.choices[0].message.content == text
    assert r.usage == chunks[-1].usage


def test_max_tokens_is_length_with_exact_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert r.choices[0].text


def test_completion_from_token_ids_equals_text(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    tokenizer = Tokenizer.from_file(str(resolve_model(None).path / "tokenizer.json"))
    ids = tokenizer.encode(prompt, add_special_tokens=True).ids
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)


def test_stop_strings(client: openai.OpenAI) -> None:
    def ask(**extra: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0, max_tokens=32, **extra
        )

    full = ask().choices[0].message.content
    assert full and "Paris" in full
    r = ask(stop=["Paris", "never-there"])
    assert r.choices[0].message.content == full[: full.index("Paris")]
    assert r.choices[0].finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
    )
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content
    content = r.choices[0].logprobs.content
    assert r.usage is not None and len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        assert entry.bytes == entry.top_logprobs[0].bytes
    # each token's raw bytes, joined, are the answer's UTF-8
    answer = r.choices[0].message.content or ""
    assert b"".join(bytes(e.bytes or []) for e in content) == answer.encode()


def test_raw_sse_framing(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw[: -len("\n\n")].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] is not None


async def test_concurrent_async_streams(daemon: Daemon) -> None:
    async with async_client(daemon) as client:

        async def one(i: int) -> tuple[str, str | None]:
            stream = await client.completions.create(
                model=MODEL,
                prompt=f"Fact number {i}:",
                max_tokens=12,
                temperature=0.7,
                seed=i,
                stream=True,
            )
            chunks = [c async for c in stream]
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

        results = await asyncio.gather(*(one(i) for i in range(32)))
    assert all(text and finish in ("stop", "length") for text, finish in results)
    wait_until(lambda: idle(daemon), 20, "all requests closed and blocks freed")


async def test_async_chat(daemon: Daemon) -> None:
    async with async_client(daemon) as client:
        r = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0, max_tokens=32
        )
    assert r.choices[0].message.content and "Paris" in r.choices[0].message.content


def test_disconnect_mid_stream_frees_everything(daemon: Daemon, http: httpx.Client) -> None:
    body = {
        "model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 900,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):  # a few tokens in: the request runs in the engine
            while not next(lines).startswith("data: "):
                pass
        wait_until(lambda: daemon.worker("api-0")["inflight"] == 1, 5, "the request in flight")
    wait_until(lambda: idle(daemon), 20, "the aborted request's blocks freed")


# Runs after the answers above: it looks for what they served (a chat completion's 200).


def test_metrics(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    for name in (
        "lmd_time_to_first_token_seconds_bucket",
        "lmd_time_per_output_token_seconds_bucket",
        "lmd_e2e_request_latency_seconds_bucket",
        "lmd_prompt_tokens_total",
        "lmd_generation_tokens_total",
        'lmd_requests_total{endpoint="chat_completions",status="200"}',
        "lmd_requests_running",
    ):
        assert name in text
