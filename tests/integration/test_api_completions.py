"""/v1/chat/completions and /v1/completions on the api worker (api_stack.py): whole
answers, streams, and aborts when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json

from lmd import protocol
from tests.integration.api_stack import MODEL, REPLY, Stack, chat_body, wait_for


def sse_events(raw: str) -> list[str]:
    """The data of each event; asserts the framing (data lines, blank-line separated)."""
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e[6:] for e in events]


# Non-streaming -------------------------------------------------------------------------


async def test_chat_answer_and_usage(stack: Stack) -> None:
    r = await stack.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}]
    )
    assert r.choices[0].message.content == "".join(REPLY)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 5, 11)
    sent = stack.tokenizer.requests[-1]
    assert sent.reply_to == "api-0" and sent.request_id == r.id
    assert sent.messages == [{"role": "user", "content": "What is the capital of France?"}]
    assert stack.worker.inflight() == 0


async def test_max_tokens_is_length_with_exact_usage(stack: Stack) -> None:
    r = await stack.openai.completions.create(model=MODEL, prompt="hello there", max_tokens=3)
    assert r.choices[0].text == "Paris is the"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 3
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert stack.tokenizer.requests[-1].sampling["max_tokens"] == 3


async def test_completion_from_token_ids(stack: Stack) -> None:
    r = await stack.openai.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8)
    sent = stack.tokenizer.requests[-1]
    assert protocol.unpack_ids(sent.prompt_ids) == [1, 2, 3] and sent.prompt is None
    assert r.usage is not None and r.usage.prompt_tokens == 3


async def test_sampling_fields_reach_the_tokenizer(stack: Stack) -> None:
    body = chat_body(
        temperature=0, top_p=0.5, top_k=7, min_p=0.1, seed=3, stop=["\n", "END"],
        repetition_penalty=1.1, min_tokens=2, ignore_eos=True, skip_special_tokens=False,
        max_completion_tokens=9, presence_penalty=0.5, frequency_penalty=-1,
        logit_bias={"17": 5}, bad_words=["END"], user="someone", unknown_field={"x": 1},
    )  # fmt: skip
    r = await stack.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    sent = stack.tokenizer.requests[-1]
    assert sent.sampling == {
        "temperature": 0.0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.1,
        "seed": 3, "min_new_tokens": 2, "stop_token_ids": [], "ignore_eos": True,
        "logprobs": None, "max_tokens": 9, "presence_penalty": 0.5, "frequency_penalty": -1.0,
        "logit_bias": [[17, 5.0]], "bad_words": ["END"],
    }  # fmt: skip
    assert sent.stop == ["\n", "END"] and sent.skip_special_tokens is False


async def test_chat_logprobs(stack: Stack) -> None:
    r = await stack.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2
    )
    assert stack.tokenizer.requests[-1].sampling["logprobs"] == 2
    content = r.choices[0].logprobs and r.choices[0].logprobs.content
    assert content and [c.token for c in content] == REPLY
    assert content[0].logprob == -0.25 and len(content[0].top_logprobs) == 2
    assert content[0].bytes == list(b"Paris")


# Streaming -----------------------------------------------------------------------------


async def test_chat_stream_with_usage(stack: Stack) -> None:
    stream = await stack.openai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(REPLY)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    await wait_for(lambda: stack.worker.inflight() == 0, "request closed")


async def test_raw_sse_framing(stack: Stack) -> None:
    r = await stack.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(REPLY)
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_disconnect_mid_stream_aborts(stack: Stack) -> None:
    async with stack.http.stream(
        "POST", "/v1/chat/completions", json=chat_body("slow", max_tokens=1000, stream=True)
    ) as r:
        lines = r.aiter_lines()
        while "tok" not in await anext(lines):
            pass
        assert stack.worker.inflight() == 1
    rid = stack.tokenizer.requests[-1].request_id
    await wait_for(lambda: rid in stack.tokenizer.aborted, "Abort at the tokenizer")
    assert stack.worker.inflight() == 0


async def test_disconnect_while_waiting_non_stream_aborts(stack: Stack) -> None:
    task = asyncio.create_task(
        stack.http.post("/v1/chat/completions", json=chat_body("slow", max_tokens=1000))
    )
    # admitted by the api and received by the tokenizer (the api counts it in flight
    # before its TextRequest has crossed the socket)
    await wait_for(
        lambda: stack.worker.inflight() == 1 and stack.tokenizer.requests, "request admitted"
    )
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    rid = stack.tokenizer.requests[-1].request_id
    await wait_for(lambda: rid in stack.tokenizer.aborted, "Abort at the tokenizer")
    assert stack.worker.inflight() == 0


async def test_concurrent_streams_all_complete(stack: Stack) -> None:
    async def one(i: int) -> str:
        stream = await stack.openai.completions.create(model=MODEL, prompt=f"p {i}", stream=True)
        return "".join([c.choices[0].text async for c in stream])

    texts = await asyncio.gather(*(one(i) for i in range(32)))
    assert texts == ["".join(REPLY)] * 32
    assert stack.worker.inflight() == 0
