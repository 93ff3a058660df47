"""lmd.pipeline against a real daemon on the same model (the embedded SmolLM2, CPU):
greedy text, token counts and finish reasons are the same, for chats, raw prompts and
token ids, whether the daemon runs hybrid or disaggregated."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from lmd import GenerationConfig, Pipeline, PytorchEngineConfig, Response, pipeline
from tests.integration.daemon import Daemon
from tests.models import QUESTIONS

MAX_TOKENS = 24
QUESTIONS_USED = QUESTIONS[:4]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module", params=["hybrid", "disaggregated"])
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    d = Daemon("--mode", request.param, "--heartbeat-timeout", "10")
    try:
        d.start()
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def pipe() -> Iterator[Pipeline]:
    with pipeline(None, backend_config=PytorchEngineConfig(device_type="cpu")) as p:
        yield p


def post(daemon: Daemon, path: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, **body}
    reply = httpx.post(f"{daemon.url}{path}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def same(response: Response | list[Response], answer: dict[str, Any], text: str) -> None:
    assert isinstance(response, Response)
    usage = answer["usage"]
    assert response.text == text
    assert response.finish_reason == answer["choices"][0]["finish_reason"]
    assert response.generate_token_len == usage["completion_tokens"]
    assert response.input_token_len == usage["prompt_tokens"]


def test_greedy_output_equals_the_daemons(daemon: Daemon, pipe: Pipeline) -> None:
    gen = GenerationConfig(max_new_tokens=MAX_TOKENS)
    for question in QUESTIONS_USED:
        messages = [{"role": "user", "content": question}]
        chat = post(daemon, "/v1/chat/completions", {"messages": messages})
        same(pipe(messages, gen), chat, chat["choices"][0]["message"]["content"])
        same(pipe(question, gen), chat, chat["choices"][0]["message"]["content"])
        raw = post(daemon, "/v1/completions", {"prompt": question})
        same(pipe(question, gen, do_preprocess=False), raw, raw["choices"][0]["text"])
        ids = pipe.tokenizer(question)["input_ids"]
        by_ids = post(daemon, "/v1/completions", {"prompt": ids})
        same(pipe(ids, gen), by_ids, by_ids["choices"][0]["text"])
