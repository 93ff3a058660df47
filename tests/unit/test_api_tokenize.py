"""The api's calls to the tokenizer for /tokenize and /detokenize (api/tokenize.py): each
gets its answer, an error, or a 503 when the tokenizer cannot answer; and the bodies'
validation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import ValidationError

from lmd import protocol
from lmd.api.openai_schema import ApiError
from lmd.api.tokenize import DetokenizeRequest, TokenizerCalls, TokenizeRequest
from tests.unit.test_openai_tools import ROUND_TRIP, WEATHER

ASK = protocol.Tokenize("tok-1", "api-0", "Hello", None, True, True, False)


async def ask(calls: TokenizerCalls, *, pushed: bool = True) -> asyncio.Task[protocol.Tokenized]:
    sent: list[protocol.Message] = []

    def push(worker: str, msg: protocol.Message) -> bool:
        sent.append(msg)
        return pushed

    task = asyncio.ensure_future(calls.ask("tokenizer-0", ASK, push))
    await asyncio.sleep(0)
    assert sent == [ASK]
    return task


async def test_the_answer_goes_to_its_call() -> None:
    calls = TokenizerCalls()
    task = await ask(calls)
    assert len(calls) == 1
    late = protocol.Tokenized("tok-2", b"", "x", None, 8)
    assert calls.answer(late)  # nobody waits for it any more: taken, dropped
    assert not calls.answer(protocol.RequestError("chatcmpl-1", "internal_error", "x"))
    assert not calls.answer(protocol.Abort("tok-1"))  # not an answer
    answer = protocol.Tokenized("tok-1", protocol.pack_ids([1]), "", None, 8)
    assert calls.answer(answer)
    assert await task == answer and len(calls) == 0


async def test_an_error_answer_is_its_http_error() -> None:
    calls = TokenizerCalls()
    task = await ask(calls)
    calls.answer(protocol.RequestError("tok-1", "invalid_request_error", "token id 9 is outside"))
    with pytest.raises(ApiError) as info:
        await task
    assert info.value.status == 400 and "token id 9" in info.value.message


@pytest.mark.parametrize(
    ("workers", "missing"),
    [({"api-0": 1}, []), ({}, ["tokenizer"])],  # gone from the workers, or its role missing
)
async def test_a_tokenizer_that_stops_fails_its_calls_at_once(
    workers: dict[str, int], missing: list[str]
) -> None:
    calls = TokenizerCalls()
    task = await ask(calls)
    calls.fail_lost({"tokenizer-0": 5, "api-0": 1}, [])  # still there: nothing happens
    await asyncio.sleep(0)
    assert not task.done()
    calls.fail_lost(workers, missing)
    with pytest.raises(ApiError) as info:
        await task
    assert info.value.status == 503 and info.value.retry_after_s == 1


async def test_a_call_that_cannot_be_sent_is_a_503() -> None:
    calls = TokenizerCalls()
    task = await ask(calls, pushed=False)
    with pytest.raises(ApiError) as info:
        await task
    assert info.value.status == 503 and info.value.type == "overloaded" and len(calls) == 0


def body(kind: type[TokenizeRequest | DetokenizeRequest], **fields: Any) -> Any:
    return kind.model_validate_json(json.dumps(fields))


def test_tokenize_bodies_become_their_message() -> None:
    prompt = body(TokenizeRequest, prompt="Hi").message("tok-1", "api-0")
    assert prompt == protocol.Tokenize("tok-1", "api-0", "Hi", None, True, True, False)
    chat = body(
        TokenizeRequest,
        model="m",
        messages=ROUND_TRIP,
        tools=[WEATHER],
        add_generation_prompt=False,
        return_token_strs=True,
        chat_template_kwargs={"enable_thinking": False},
    ).message("tok-2", "api-0")
    assert chat.messages[1]["tool_calls"] == ROUND_TRIP[1]["tool_calls"]
    assert (chat.add_special_tokens, chat.add_generation_prompt, chat.return_token_strs) == (
        False,
        False,
        True,
    )  # a chat's template writes its special tokens
    assert chat.tools == [WEATHER] and chat.chat_template_kwargs == {"enable_thinking": False}
    assert protocol.decode(protocol.encode(chat)) == chat
    ids = body(DetokenizeRequest, tokens=[1, 2]).message("tok-3", "api-0")
    assert protocol.unpack_ids(ids.token_ids) == [1, 2]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({}, "either prompt or messages"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "either"),
        ({"prompt": "a", "tools": [WEATHER]}, "go with messages"),
        ({"prompt": "a", "chat_template_kwargs": {}}, "go with messages"),
        ({"prompt": 1}, "valid string"),
    ],
)
def test_bad_tokenize_bodies(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as info:
        body(TokenizeRequest, **fields)
    assert says in ApiError.from_validation(info.value).message
