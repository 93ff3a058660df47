"""lmd.pipeline against a real daemon on the same model (the embedded SmolLM2, CPU):
greedy text, token counts and finish reasons are the same, for chats, raw prompts and
token ids, whether the daemon runs hybrid or disaggregated."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from lmd import GenerationConfig, Pipeline, PytorchEngineConfig, Response, pipeline
from tests.integration.daemon import Daemon, served
from tests.models import QUESTIONS

MAX_TOKENS = 24
QUESTIONS_USED = QUESTIONS[:4]
MODEL = "SmolLM2-135M-Instruct"
CHAT, RAW = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module", params=["hybrid", "disaggregated"])
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    # fp32 GEMMs on both sides: bf16's outputs depend on the batch (test_migration.py).
    fp32 = ("--cpu-matmul-dtype", "float32")
    yield from served(Daemon("--mode", request.param, "--heartbeat-timeout", "10", *fp32))


@pytest.fixture(scope="module")
def pipe() -> Iterator[Pipeline]:
    config = PytorchEngineConfig(device_type="cpu", cpu_matmul_dtype="float32")
    with pipeline(None, backend_config=config) as p:
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
    """Every prompt of a kind in one pipeline call and in concurrent daemon requests (both
    batch them; a batch gives what one at a time gives, tests/unit/test_pipeline.py)."""
    gen = GenerationConfig(max_new_tokens=MAX_TOKENS)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS_USED]
    ids = [pipe.tokenizer(q)["input_ids"] for q in QUESTIONS_USED]
    with ThreadPoolExecutor(len(QUESTIONS_USED)) as pool:
        by_chat = list(pool.map(lambda m: post(daemon, CHAT, {"messages": m}), chats))
        by_raw = list(pool.map(lambda q: post(daemon, RAW, {"prompt": q}), QUESTIONS_USED))
        by_ids = list(pool.map(lambda i: post(daemon, RAW, {"prompt": i}), ids))
    chat_texts = [a["choices"][0]["message"]["content"] for a in by_chat]
    raw_texts = [a["choices"][0]["text"] for a in by_raw]
    ids_texts = [a["choices"][0]["text"] for a in by_ids]
    calls = [
        (pipe(chats, gen), by_chat, chat_texts),
        (pipe(QUESTIONS_USED, gen), by_chat, chat_texts),
        (pipe(QUESTIONS_USED, gen, do_preprocess=False), by_raw, raw_texts),
        (pipe(ids, gen), by_ids, ids_texts),
    ]
    for responses, answers, texts in calls:
        assert isinstance(responses, list) and len(responses) == len(answers)
        for response, answer, text in zip(responses, answers, texts, strict=True):
            same(response, answer, text)
