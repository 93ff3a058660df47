"""Prefix cache reuse (cached_tokens), and /v1/chat/interactive: sessions the server
remembers, so a turn prefills only its new tokens; streams, resets, ends, cancels."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.daemon import Daemon, wait_until
from tests.integration.openai_api.shared_daemon import MODEL, QUESTION, idle

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
