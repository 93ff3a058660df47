"""Tool calls and reasoning in /v1/chat/completions answers, through the api worker
(api_stack.py: the fake tokenizer "says" a scripted reply) and the official SDK."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.integration.api_stack import MODEL, Stack

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
REPLY = (
    "<think>\nTwo cities.\n</think>\n\nChecking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
)


@pytest.fixture
async def tools_stack() -> AsyncIterator[Stack]:
    s = Stack(tool_call_parser="hermes", reasoning_parser="qwen3")
    await s.start()
    try:
        yield s
    finally:
        await s.close()


async def ask(stack: Stack, say: str, **extra: Any) -> Any:
    return await stack.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"say:{say}"}], **extra
    )


async def ask_streamed(stack: Stack, say: str, **extra: Any) -> dict[str, Any]:
    """A stream as a client adds it up: each field joined, the calls merged by index."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    async for chunk in await ask(stack, say, stream=True, **extra):
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
        for entry in delta.tool_calls or []:
            call = out["calls"].setdefault(entry.index, {"name": None, "arguments": ""})
            if entry.id is not None:
                assert entry.type == "function" and call["name"] is None
                call["name"] = entry.function.name
            call["arguments"] += entry.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [out["calls"][i] for i in sorted(out["calls"])]
    return out


async def test_calls_and_reasoning_whole_and_streamed(tools_stack: Stack) -> None:
    r = await ask(tools_stack, REPLY, tools=[WEATHER])
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking."
    assert (message.model_extra or {})["reasoning_content"] == "Two cities."
    calls = message.tool_calls or []
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Paris"},
        {"city": "Lyon"},
    ]
    assert all(c.id.startswith("call_") and c.function.name == "get_weather" for c in calls)

    streamed = await ask_streamed(tools_stack, REPLY, tools=[WEATHER])
    assert streamed == {
        "content": "Checking.",
        "reasoning": "Two cities.",
        "calls": [{"name": c.function.name, "arguments": c.function.arguments} for c in calls],
        "finish": "tool_calls",
    }


async def test_tool_choice_none_and_no_tools_leave_the_reply_as_content(tools_stack: Stack) -> None:
    for extra in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        r = await ask(tools_stack, REPLY, **extra)
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content is not None
        assert r.choices[0].message.content.startswith("Checking.\n<tool_call>")


async def test_a_named_tool_choice_reads_the_reply_as_its_arguments(tools_stack: Stack) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    arguments = '{"city": "Paris"}'
    r = await ask(tools_stack, arguments, tools=[WEATHER], tool_choice=named)
    (call,) = r.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)
    streamed = await ask_streamed(tools_stack, arguments, tools=[WEATHER], tool_choice=named)
    assert streamed["calls"] == [{"name": "get_weather", "arguments": arguments}]


async def test_required_reads_the_constrained_array(tools_stack: Stack) -> None:
    say = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    r = await ask(tools_stack, say, tools=[WEATHER], tool_choice="required")
    (call,) = r.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert r.choices[0].finish_reason == "tool_calls"
