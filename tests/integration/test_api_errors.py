"""Errors on the api worker (api_stack.py): bad parameters and bodies, unknown models,
limits, tokenizer errors and loss, draining, and API keys."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from lmd import protocol
from tests.integration.api_stack import MODEL, Stack, assert_error, chat_body, wait_for

KEY = "sk-test-key"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(temperature=-1), "temperature"),
        (chat_body(temperature="0.5"), "temperature"),
        (chat_body(top_p=0), "top_p"),
        (chat_body(max_tokens=0), "max_tokens"),
        (chat_body(n=17), "n"),
        (chat_body(presence_penalty=2.5), "presence_penalty"),
        (chat_body(frequency_penalty="1"), "frequency_penalty"),
        (chat_body(logit_bias={"a": 1}), "logit_bias"),
        (chat_body(bad_words="foo"), "bad_words"),
        (chat_body(top_logprobs=3), "top_logprobs"),
        (chat_body(stream="yes"), "stream"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ({"model": MODEL, "prompt": "a", "echo": True}, "echo"),
        ({"model": MODEL, "prompt": "a", "logprobs": 6}, "logprobs"),
    ],
)
async def test_bad_parameters_are_400_naming_the_field(
    stack: Stack, body: dict[str, Any], param: str
) -> None:
    path = (
        "/v1/chat/completions" if "messages" in body or "prompt" not in body else "/v1/completions"
    )
    err = assert_error(await stack.http.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"
    assert not stack.tokenizer.requests


async def test_malformed_json_is_400(stack: Stack) -> None:
    r = await stack.http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "not valid JSON" in assert_error(r, 400)["message"]
    assert_error(await stack.http.post("/v1/completions", content=b"[1, 2]"), 400)


async def test_unknown_model_is_404(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        await stack.openai.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "hi"}]
        )
    assert exc.value.code == "model_not_found" and MODEL in exc.value.message


async def test_body_over_the_limit_is_413(stack: Stack) -> None:
    big = chat_body("x" * (stack.config.max_request_bytes + 1))
    assert_error(await stack.http.post("/v1/chat/completions", json=big), 413)

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
        yield json.dumps(big).encode()

    assert_error(await stack.http.post("/v1/chat/completions", content=chunked()), 413)


@pytest.mark.parametrize("stream", [False, True])
async def test_tokenizer_errors_map_to_http(stack: Stack, stream: bool) -> None:
    for code, status in [
        ("invalid_request_error", 400),
        ("overloaded", 503),
        ("internal_error", 500),
    ]:
        r = await stack.http.post(
            "/v1/chat/completions", json=chat_body(f"error:{code}", stream=stream)
        )
        assert assert_error(r, status)["type"] == code
        assert ("retry-after" in r.headers) == (status == 503)
    assert stack.worker.inflight() == 0


async def test_draining_is_503_with_retry_after(stack: Stack) -> None:
    await stack.supervisor.send(protocol.Drain())
    await wait_for(lambda: stack.worker.draining, "drain")
    r = await stack.http.post("/v1/chat/completions", json=chat_body())
    assert_error(r, 503)
    assert int(r.headers["retry-after"]) > 0
    assert (await stack.http.get("/health")).status_code == 503
    await stack.supervisor.send(protocol.Resume())
    await wait_for(lambda: not stack.worker.draining, "resume")
    assert (await stack.http.post("/v1/chat/completions", json=chat_body())).status_code == 200


async def test_tokenizer_loss_fails_open_requests(stack: Stack) -> None:
    task = asyncio.create_task(
        stack.http.post("/v1/chat/completions", json=chat_body("slow", max_tokens=1000))
    )
    await wait_for(lambda: stack.worker.inflight() == 1, "request admitted")
    await stack.supervisor.send(protocol.ClusterState("running", ["tokenizer"]))
    r = await asyncio.wait_for(task, 5)
    assert_error(r, 503)
    assert "tokenizer" in r.json()["error"]["message"]
    assert stack.worker.inflight() == 0
    r = await stack.http.post("/v1/chat/completions", json=chat_body())
    assert "tokenizer" in assert_error(r, 503)["message"]


async def test_stop_answers_what_is_still_open(stack: Stack) -> None:
    """Stop with requests in flight (the supervisor's drain timed out): each gets a 503,
    whole or as its stream's last event, the tokenizer an Abort of each, and api-0 ends
    well within the 5 s the supervisor gives it before killing it (which dropped the
    connections unanswered)."""
    body = chat_body("slow", max_tokens=1000)
    whole = asyncio.create_task(stack.http.post("/v1/chat/completions", json=body))

    flowing = asyncio.Event()  # the stream's 200 and first chunk are out

    async def streamed() -> str:
        r = stack.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True})
        async with r as response:
            assert response.status_code == 200
            chunks = []
            async for chunk in response.aiter_text():
                chunks.append(chunk)
                flowing.set()
            return "".join(chunks)

    stream = asyncio.create_task(streamed())
    await asyncio.wait_for(flowing.wait(), 5)
    await wait_for(lambda: stack.worker.inflight() == 2, "two requests in flight")
    await stack.supervisor.send(protocol.Stop())
    r = await asyncio.wait_for(whole, 3)
    err = assert_error(r, 503)
    assert err["type"] == "service_unavailable" and "stopping" in err["message"]
    text = await asyncio.wait_for(stream, 3)
    last = [line for line in text.splitlines() if line.startswith("data: {")][-1]
    assert "stopping" in json.loads(last[len("data: ") :])["error"]["message"]
    await asyncio.wait_for(stack.worker_task, 3)
    assert stack.worker.inflight() == 0
    held = {r.request_id for r in stack.tokenizer.requests}
    await wait_for(lambda: stack.tokenizer.aborted == held, "an Abort of each")


async def test_api_keys() -> None:
    s = Stack(api_keys=(KEY, "other-key"))
    await s.start()
    try:
        assert (await s.http.get("/health")).status_code == 200
        assert_error(await s.http.get("/v1/models"), 401)
        bad = {"authorization": "Bearer nope"}
        assert (
            assert_error(await s.http.get("/v1/models", headers=bad), 401)["code"]
            == "invalid_api_key"
        )
        models = await s.openai.models.list()
        assert [m.id for m in models.data] == [MODEL]
        r = await s.openai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        assert r.choices[0].message.content
        plain = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await plain.models.list()
        await plain.close()
    finally:
        await s.close()
