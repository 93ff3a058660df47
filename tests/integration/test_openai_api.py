"""The OpenAI API end to end: the official `openai` SDK (sync and async) and raw httpx
against a real daemon in hybrid mode serving the embedded SmolLM2-135M-Instruct on CPU.

One daemon for the module (each start loads the model); it runs with an API key, so
every client here sends it, and with a short session length, so an over-long prompt is
cheap to build. Tests that change its state (drain) put it back.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from tokenizers import Tokenizer

from lmd.engine.model_source import resolve_model
from tests.integration.daemon import Daemon, wait_until

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-lmd-test"
SESSION_LEN = 1024
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = Daemon(
        "--mode", "hybrid", "--heartbeat-timeout", "10", "--api-keys", KEY,
        "--session-len", str(SESSION_LEN), "--drain-timeout", "5",
    )  # fmt: skip
    try:
        d.start()
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=60) as c:
        yield c


def async_client(daemon: Daemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key=KEY, max_retries=0)


def idle(daemon: Daemon) -> bool:
    """Nothing held anywhere: every KV block free, no request open in any process."""
    workers = {w["name"]: w for w in daemon.status()["workers"]}
    kv = workers["hybrid-0"].get("kv")
    busy = any(workers[n]["inflight"] for n in ("api-0", "tokenizer-0", "hybrid-0"))
    return bool(kv and kv["free_blocks"] == kv["total_blocks"] and not busy)


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


# Errors ---------------------------------------------------------------------------------


def test_bad_parameter_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
    assert exc.value.param == "temperature" and "temperature" in exc.value.message
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, presence_penalty=0.5)


def test_prompt_over_the_session_length_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="word " * (SESSION_LEN + 10), max_tokens=4)
    assert str(SESSION_LEN - 1) in exc.value.message  # says the limit


def test_missing_or_wrong_key_is_401(daemon: Daemon) -> None:
    assert httpx.get(f"{daemon.url}/health").status_code == 200  # exempt
    for key in ("", "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(f"{daemon.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with (
        openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.chat.completions.create(model=MODEL, messages=QUESTION)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert exc.value.code == "model_not_found"


def test_drained_is_503_with_retry_after(daemon: Daemon, http: httpx.Client) -> None:
    assert daemon.control().post("/v1/drain").status_code == 200
    try:
        daemon.wait_state("draining", 10)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        r = wait_until(
            lambda: (x := http.post("/v1/completions", json=body)).status_code == 503 and x,
            10,
            "503 from the api",
        )
        assert int(r.headers["retry-after"]) > 0
        assert r.json()["error"]["type"] == "service_unavailable"
    finally:
        daemon.control().post("/v1/resume")
        daemon.wait_state("running", 10)
    wait_until(lambda: http.get("/health").status_code == 200, 10, "healthy again")


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


# Prefix cache reuse and /v1/chat/interactive ----------------------------------------------

BLOCK_SIZE = 64  # the daemon's default --block-size
# A system prompt of several full KV blocks, so that reuse shows in cached_tokens.
TUTOR = "You are a geography tutor. Answer in one short sentence. " + " ".join(
    f"Rule {i}: be precise, friendly and brief." for i in range(20)
)


def interactive(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/chat/interactive", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def full_blocks(num_tokens: int) -> int:
    return num_tokens // BLOCK_SIZE * BLOCK_SIZE


def test_chat_sent_twice_reports_cached_tokens(client: openai.OpenAI) -> None:
    nonce = uuid.uuid4().hex  # first in the prompt: nothing before it can be cached
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": f"Session {nonce}. {TUTOR}"},
        *QUESTION,
    ]

    def cached() -> int:
        r = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=4
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        assert r.usage.prompt_tokens > 2 * BLOCK_SIZE
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert cached() == 0
    assert cached() >= 2 * BLOCK_SIZE  # every full block of the prompt but the last token's


def test_interactive_turn_two_prefills_only_new_tokens(http: httpx.Client) -> None:
    first_turn = [
        {"role": "system", "content": TUTOR},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    one = interactive(
        http, prompt=first_turn, session_id=101, interactive_mode=True, request_output_len=32
    )
    assert "Paris" in one["text"] and one["history_tokens"] == 0
    assert one["finish_reason"] in ("stop", "length")
    question = "And what is the capital of Germany?"
    two = interactive(
        http, prompt=question, session_id=101, interactive_mode=True, request_output_len=32
    )
    # The history is turn 1's prompt and answer (+ the template's newline after it); the
    # prefix cache holds its full blocks (the last sampled token's KV is never computed).
    turn_one = one["input_tokens"] + one["tokens"]
    assert turn_one <= two["history_tokens"] <= turn_one + 2
    assert two["cached_tokens"] >= full_blocks(turn_one - 1) >= 4 * BLOCK_SIZE
    assert two["input_tokens"] < 32  # only the new turn was tokenized
    assert "Berlin" in two["text"]
    # Coherent: the same answer as the whole conversation sent to chat completions.
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [
                *first_turn,
                {"role": "assistant", "content": one["text"]},
                {"role": "user", "content": question},
            ],
            "temperature": 0,
            "max_tokens": 32,
        },
    ).json()
    assert chat["choices"][0]["message"]["content"] == two["text"]
    assert chat["usage"]["prompt_tokens"] == two["input_tokens"] + two["history_tokens"]


def test_interactive_stream_is_json_lines(http: httpx.Client) -> None:
    body = {"prompt": "Name a colour.", "session_id": 102, "interactive_mode": True,
            "request_output_len": 16, "temperature": 0, "stream": True}  # fmt: skip
    with http.stream("POST", "/v1/chat/interactive", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        raw = r.read().decode()
    assert raw.endswith("\n")
    chunks = [json.loads(line) for line in raw.splitlines()]
    assert all(set(c) >= {"text", "tokens", "input_tokens", "history_tokens"} for c in chunks)
    assert chunks[-1]["finish_reason"] in ("stop", "length")
    assert not any(c["finish_reason"] for c in chunks[:-1])
    text = "".join(c["text"] for c in chunks)
    # The streamed turn joined the history: the next one starts after it.
    again = interactive(http, prompt="Another one.", session_id=102, interactive_mode=True,
                        request_output_len=8)  # fmt: skip
    assert again["history_tokens"] >= chunks[-1]["input_tokens"] + chunks[-1]["tokens"]
    assert text


def test_interactive_mode_false_starts_afresh(http: httpx.Client) -> None:
    interactive(http, prompt=f"My name is {uuid.uuid4().hex}.", session_id=103,
                interactive_mode=True, request_output_len=8)  # fmt: skip
    reset = interactive(
        http,
        prompt=f"Unrelated {uuid.uuid4().hex}: count to five.",
        session_id=103,
        interactive_mode=False,
        request_output_len=8,
    )
    assert reset["history_tokens"] == 0 and reset["cached_tokens"] == 0
    # A one-off turn keeps nothing: the next interactive turn starts an empty session.
    after = interactive(
        http, prompt="Hello.", session_id=103, interactive_mode=True, request_output_len=4
    )
    assert after["history_tokens"] == 0


def test_interactive_end_session(http: httpx.Client) -> None:
    interactive(http, prompt="Hi.", session_id=104, interactive_mode=True, request_output_len=4)
    ended = interactive(http, prompt="", session_id=104)
    assert ended == {"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0,
                     "finish_reason": "stop", "cached_tokens": 0}  # fmt: skip
    again = interactive(
        http, prompt="Hi.", session_id=104, interactive_mode=True, request_output_len=4
    )
    assert again["history_tokens"] == 0


def test_interactive_busy_session_and_cancel(daemon: Daemon, http: httpx.Client) -> None:
    interactive(http, prompt="Hi.", session_id=105, interactive_mode=True, request_output_len=4)
    before = interactive(
        http, prompt="Hi again.", session_id=105, interactive_mode=True, request_output_len=4
    )
    body = {"prompt": "Count to a thousand:", "session_id": 105, "interactive_mode": True,
            "request_output_len": 900, "ignore_eos": True, "stream": True}  # fmt: skip
    with http.stream("POST", "/v1/chat/interactive", json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(lines))
        assert first["finish_reason"] is None
        busy = http.post("/v1/chat/interactive", json={**body, "stream": False})
        assert busy.status_code == 400 and "session 105 is busy" in busy.json()["error"]["message"]
        assert interactive(http, prompt="", session_id=105, cancel=True)["finish_reason"] == "stop"
        chunks = [json.loads(line) for line in lines]
    assert chunks[-1]["finish_reason"] == "abort" and chunks[-1]["tokens"] < 900
    # The cancelled turn is not kept: the next turn follows the turns before it.
    after = interactive(
        http, prompt="Hi once more.", session_id=105, interactive_mode=True, request_output_len=4
    )
    kept = before["history_tokens"] + before["input_tokens"] + before["tokens"]
    assert kept <= after["history_tokens"] <= kept + 2
    wait_until(lambda: idle(daemon), 20, "the cancelled turn's blocks freed")


def test_interactive_bad_requests_are_400(http: httpx.Client) -> None:
    for body, says in (
        ({"prompt": "Hi", "interactive_mode": True}, "needs a session_id"),
        ({"prompt": "Hi", "cancel": True}, "needs a session_id"),
        ({"prompt": "", "session_id": 5, "interactive_mode": True}, "must not be empty"),
        ({"prompt": "Hi", "session_id": 5, "image_url": "x"}, "image_url"),
        ({"prompt": "Hi", "session_id": 5, "top_p": 0}, "top_p"),
    ):
        r = http.post("/v1/chat/interactive", json=body)
        assert r.status_code == 400 and says in r.json()["error"]["message"], (body, r.text)
