"""Structured output and forced tool calls through a real daemon (hybrid, and
disaggregated with the grammar handed from prefill to decode): a tiny random-weight Llama
over SmolLM2's tokenizer writes whatever its weights say, and every answer must still
parse and validate, streamed and not. The official SDK's `parse()` and forced tool calls
go through unmodified."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.daemon import Daemon
from tests.unit.test_grammar import PERSON, guided_llama, jsonschema

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}


class Pet(BaseModel):
    """What `parse(response_format=Pet)` sends as a strict JSON schema."""

    name: str = Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    friends: list[Literal["a", "b"]] = Field(max_length=2)


@pytest.fixture(scope="module", params=["hybrid", "disaggregated"])
def client(
    request: pytest.FixtureRequest, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    model = guided_llama(tmp_path_factory.mktemp("guided"), smollm2_dir)
    daemon = Daemon(
        str(model), "--mode", request.param, "--cache-max-entry-count", "64",
        "--model-name", "x",
    )  # fmt: skip
    try:
        daemon.start()
        with openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="-", max_retries=0) as c:
            yield c
    finally:
        daemon.close()


def chat(
    client: openai.OpenAI, i: int, stream: bool, ends: bool = True, **fields: Any
) -> tuple[str, list[tuple[str, str]]]:
    """One chat request (sampled, seeded by i): its content and its tool calls as
    (name, arguments); `ends`: the constraint is bounded, so it ends before max_tokens."""
    create: Any = client.chat.completions.create  # the SDK's overloads want typed dicts
    request = {
        "model": "x",
        "messages": [{"role": "user", "content": f"Question {i}: tell me about it."}],
        "temperature": 1.0,
        "seed": i,
        "max_tokens": 200,
        **fields,
    }
    if not stream:
        choice = create(**request).choices[0]
        assert not ends or choice.finish_reason in ("stop", "tool_calls")
        made = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.message.content or "", made
    content, finish = "", None
    calls: dict[int, list[str]] = {}  # index -> [name, arguments]
    for chunk in create(**request, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += (call.function and call.function.name) or ""
            entry[1] += (call.function and call.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert not ends or finish in ("stop", "tool_calls")
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)]


def test_a_hundred_json_schema_answers_all_validate(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def one(i: int) -> str:
        return chat(client, i, stream=i % 2 == 1, response_format=fmt)[0]

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(100)))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_guided_choice(client: openai.OpenAI) -> None:
    # unbounded: a random model may write one string until max_tokens
    for i in range(4):
        fmt = {"type": "json_object"}
        text, _ = chat(client, i, stream=i % 2 == 1, ends=False, response_format=fmt)
        assert text.startswith("{")  # an object, never an array or a string
        if text.endswith("}"):
            assert isinstance(json.loads(text), dict)
    choices = ["red", "green", "blue"]
    for i in range(4):
        text, _ = chat(client, i, stream=False, extra_body={"guided_choice": choices})
        assert text in choices


def test_the_sdks_parse_returns_the_model(client: openai.OpenAI) -> None:
    for i in range(4):
        out = client.chat.completions.parse(
            model="x",
            messages=[{"role": "user", "content": f"a pet, please ({i})"}],
            response_format=Pet,
            temperature=1.0,
            seed=i,
            max_tokens=200,
        )
        pet = out.choices[0].message.parsed
        assert isinstance(pet, Pet)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_always_calls_it_with_valid_arguments(
    client: openai.OpenAI, stream: bool
) -> None:
    forced = {"type": "function", "function": {"name": "get_weather"}}
    for i in range(6):
        content, calls = chat(client, i, stream, tools=[WEATHER, TIME], tool_choice=forced)
        assert not content and len(calls) == 1
        name, arguments = calls[0]
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_calls_the_given_tools(client: openai.OpenAI) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for i in range(6):
        _, calls = chat(client, i, stream=i % 2 == 1, tools=[WEATHER, TIME], tool_choice="required")
        assert calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])


def test_a_tool_round_trip(client: openai.OpenAI) -> None:
    """A forced call, its result sent back in the next turn, rendered by the template."""
    create: Any = client.chat.completions.create
    question = {"role": "user", "content": "The weather in Oslo for 3 days?"}
    forced = {"type": "function", "function": {"name": "get_weather"}}
    first = create(model="x", messages=[question], tools=[WEATHER], tool_choice=forced, seed=1)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assistant = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
    second = create(
        model="x", messages=[question, assistant, result], tools=[WEATHER], max_tokens=8
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 5  # call and result


def test_langchains_structured_output_and_bound_tools(client: openai.OpenAI) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=str(client.base_url), api_key="-", model="x", temperature=1.0, max_tokens=200,
        max_retries=0, seed=3,
    )  # fmt: skip
    pet = llm.with_structured_output(Pet).invoke("A pet, please.")
    assert isinstance(pet, Pet)
    bound = llm.bind_tools([WEATHER, TIME], tool_choice="get_weather")
    message = bound.invoke("The weather in Oslo?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
