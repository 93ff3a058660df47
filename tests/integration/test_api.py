"""The api worker over real HTTP and real ZeroMQ, with a fake tokenizer and supervisor.

The ApiWorker runs its full `Worker.run` in the test's event loop; a fake supervisor (a
ROUTER on supervisor.ipc) tells it the cluster state, and a fake tokenizer (a PULL on
tokenizer-0.ipc) answers each TextRequest with scripted TextDeltas, so every path of the
front (stream, errors, aborts, auth, limits, metrics) is checked without a model.

Fake tokenizer script, by the prompt (or the last chat message):
  "error:CODE"  -> RequestError(CODE)
  "slow"        -> one token every 20 ms until max_tokens or an Abort
  anything else -> the words of REPLY, one delta each, finish "stop"; or "length" at
                   max_tokens. prompt_tokens = number of words (or ids) in the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq
import zmq.asyncio

from lmd import protocol
from lmd.api.worker import ApiWorker
from lmd.config import ServeConfig
from lmd.worker import WorkerSpec
from tests.integration.daemon import free_port

MODEL = "SmolLM2-135M-Instruct"
REPLY = ["Paris", " is", " the", " capital", "."]
KEY = "sk-test-key"


class FakeTokenizer:
    def __init__(self, ctx: zmq.asyncio.Context, runtime_dir: Path) -> None:
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(f"ipc://{runtime_dir}/tokenizer-0.ipc")
        self.api = ctx.socket(zmq.PUSH)
        self.api.connect(f"ipc://{runtime_dir}/api-0.ipc")
        self.requests: list[protocol.TextRequest] = []
        self.aborted: set[str] = set()
        self.controls: list[protocol.SessionControl] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        while True:
            msg = protocol.decode(await self.inbox.recv_multipart())
            if isinstance(msg, protocol.Abort):
                self.aborted.add(msg.request_id)
            elif isinstance(msg, protocol.SessionControl):
                self.controls.append(msg)
            elif isinstance(msg, protocol.TextRequest):
                self.requests.append(msg)
                task = asyncio.create_task(self._answer(msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _send(self, msg: protocol.Message) -> None:
        await self.api.send_multipart(protocol.encode(msg))

    async def _answer(self, req: protocol.TextRequest) -> None:
        text = req.messages[-1]["content"] if req.messages is not None else req.prompt or ""
        prompt_tokens = len(text.split()) or len(req.prompt_ids) // 4
        if text.startswith("error:"):
            await self._send(protocol.RequestError(req.request_id, text[6:], f"{text[6:]} here"))
            return
        max_tokens = req.sampling.get("max_tokens", 256)
        words = ["tok"] * max_tokens if text == "slow" else REPLY
        n_top = req.sampling.get("logprobs")
        for i, word in enumerate(words[:max_tokens], start=1):
            if req.request_id in self.aborted:
                return
            last = i == min(len(words), max_tokens)
            reason = None if not last else ("length" if i == max_tokens else "stop")
            lps = None
            if n_top is not None:
                lps = [{"token": word, "logprob": -0.25, "top": [[word, -0.25]] * n_top}]
            await self._send(
                protocol.TextDelta(
                    [req.request_id], [word], [reason], [prompt_tokens], [i], [lps], [0], [0]
                )
            )
            await asyncio.sleep(0.02 if text == "slow" else 0)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.inbox.close(0)
        self.api.close(0)


class FakeSupervisor:
    def __init__(self, ctx: zmq.asyncio.Context, runtime_dir: Path) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"ipc://{runtime_dir}/supervisor.ipc")
        self.ready = asyncio.Event()

    async def run(self) -> None:
        while True:
            _, *frames = await self.router.recv_multipart()
            if isinstance(protocol.decode(frames), protocol.Ready):
                self.ready.set()

    async def send(self, msg: protocol.Message) -> None:
        await self.router.send_multipart([b"api-0", *protocol.encode(msg)])

    def close(self) -> None:
        self.router.close(0)


class Stack:
    """api-0 with its fake peers, and clients for it."""

    def __init__(self, **config: Any) -> None:
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="lmda-"))
        self.config = ServeConfig(runtime_dir=self.runtime_dir, port=free_port(), **config)
        spec = WorkerSpec("api-0", "api", 0, os.getpid(), self.config.to_dict())
        self.worker = ApiWorker(spec, self.config)
        self.ctx = zmq.asyncio.Context()
        self.tokenizer = FakeTokenizer(self.ctx, self.runtime_dir)
        self.supervisor = FakeSupervisor(self.ctx, self.runtime_dir)
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.http = httpx.AsyncClient(base_url=self.url, timeout=10)
        key = config["api_keys"][0] if config.get("api_keys") else "none"
        self.openai = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(c)
            for c in (self.worker.run(), self.tokenizer.run(), self.supervisor.run())
        ]
        await asyncio.wait_for(self.supervisor.ready.wait(), 10)
        await self.supervisor.send(protocol.ClusterState("running", []))
        await wait_for(lambda: self.worker.cluster_state == "running", "cluster state")

    async def close(self) -> None:
        await self.http.aclose()
        await self.openai.close()
        with contextlib.suppress(Exception):
            await self.supervisor.send(protocol.Stop())
            await asyncio.wait_for(self._tasks[0], 10)
        for task in self._tasks:
            task.cancel()
        self.tokenizer.close()
        self.supervisor.close()
        self.ctx.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


async def wait_for(predicate: Any, what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    s = Stack()
    await s.start()
    try:
        yield s
    finally:
        await s.close()


def chat_body(content: str = "What is the capital of France?", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


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
        max_completion_tokens=9, presence_penalty=0, user="someone", unknown_field={"x": 1},
    )  # fmt: skip
    r = await stack.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    sent = stack.tokenizer.requests[-1]
    assert sent.sampling == {
        "temperature": 0.0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.1,
        "seed": 3, "min_new_tokens": 2, "stop_token_ids": [], "ignore_eos": True,
        "logprobs": None, "max_tokens": 9,
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
    await wait_for(lambda: stack.worker.inflight() == 1, "request admitted")
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


# Errors ---------------------------------------------------------------------------------


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param and param in err["message"]
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(temperature=-1), "temperature"),
        (chat_body(temperature="0.5"), "temperature"),
        (chat_body(top_p=0), "top_p"),
        (chat_body(max_tokens=0), "max_tokens"),
        (chat_body(n=2), "n"),
        (chat_body(presence_penalty=0.5), "presence_penalty"),
        (chat_body(frequency_penalty=1), "frequency_penalty"),
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


# Metrics and docs -----------------------------------------------------------------------


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


async def test_openapi_and_docs(stack: Stack) -> None:
    spec = (await stack.http.get("/openapi.json")).json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert "temperature" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert (await stack.http.get("/docs")).status_code == 200
    assert_error(await stack.http.get("/v1/nothing"), 404)


# /v1/chat/interactive ---------------------------------------------------------------------


async def test_interactive_turn_goes_to_the_tokenizer_as_a_session_turn(stack: Stack) -> None:
    body = {"prompt": "What is the capital of France?", "session_id": 9, "interactive_mode": True}
    r = await stack.http.post("/v1/chat/interactive", json=body)
    assert r.status_code == 200
    assert r.json() == {
        "text": "".join(REPLY),
        "tokens": len(REPLY),
        "input_tokens": 6,
        "history_tokens": 0,
        "finish_reason": "stop",
        "cached_tokens": 0,
    }
    sent = stack.tokenizer.requests[-1]
    assert (sent.session_id, sent.interactive_mode) == (9, True)
    assert sent.prompt == body["prompt"] and sent.messages is None
    assert sent.sampling["temperature"] == 0.8 and sent.sampling["top_k"] == 40  # LMDeploy's
    one_off = await stack.http.post("/v1/chat/interactive", json={"prompt": "Hi"})
    assert one_off.status_code == 200
    sent = stack.tokenizer.requests[-1]
    assert sent.session_id is None and sent.messages == [{"role": "user", "content": "Hi"}]


async def test_interactive_cancel_and_end_are_session_controls(stack: Stack) -> None:
    done = {"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0,
            "finish_reason": "stop", "cached_tokens": 0}  # fmt: skip
    r = await stack.http.post(
        "/v1/chat/interactive", json={"prompt": "", "session_id": 3, "cancel": True}
    )
    assert r.status_code == 200 and r.json() == done
    r = await stack.http.post("/v1/chat/interactive", json={"prompt": "", "session_id": 3})
    assert r.status_code == 200 and r.json() == done
    await wait_for(lambda: len(stack.tokenizer.controls) == 2, "both controls")
    assert [(c.session_id, c.action) for c in stack.tokenizer.controls] == [
        (3, "cancel"),
        (3, "end"),
    ]
    assert not stack.tokenizer.requests  # no turn ran


async def test_interactive_needs_prefix_caching() -> None:
    s = Stack(enable_prefix_caching=False)
    await s.start()
    try:
        body = {"prompt": "Hi", "session_id": 1, "interactive_mode": True}
        r = await s.http.post("/v1/chat/interactive", json=body)
        assert r.status_code == 400 and "--enable-prefix-caching" in r.json()["error"]["message"]
        assert not s.tokenizer.requests
    finally:
        await s.close()
