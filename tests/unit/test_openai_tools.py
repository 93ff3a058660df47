"""Tool calling fields of a chat request (openai_tools, openai_schema): what is accepted,
what reaches the tokenizer, and the 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lmd import protocol
from lmd.api.openai_schema import ChatCompletionRequest
from lmd.api.openai_tools import NamedToolChoice
from tests.unit.test_openai_schema import MODEL, error_of

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get-time_2"}}  # no parameters
CALL: dict[str, Any] = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
ROUND_TRIP: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C"},
]


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def test_tools_reach_the_tokenizer_for_the_template() -> None:
    req = chat(tools=[WEATHER, TIME], chat_template_kwargs={"enable_thinking": False})
    assert req.tool_choice == "auto" and req.parallel_tool_calls is True  # OpenAI's defaults
    msg = req.text_request("chatcmpl-1", "api-0")
    assert msg.tools == [WEATHER, TIME]  # as sent, nothing added
    assert msg.chat_template_kwargs == {"enable_thinking": False}
    assert "guided" not in msg.sampling  # auto: the model chooses, nothing constrained
    assert protocol.decode(protocol.encode(msg)) == msg


def test_without_tools_nothing_is_added() -> None:
    req = chat()
    assert req.tool_choice == "none"
    msg = req.text_request("chatcmpl-1", "api-0")
    assert msg.tools is None and msg.chat_template_kwargs is None
    assert chat(tools=[]).text_request("c", "api-0").tools is None


def test_every_tool_choice_is_kept_as_given() -> None:
    assert chat(tools=[WEATHER], tool_choice="none").tool_choice == "none"
    assert chat(tools=[WEATHER], tool_choice="required").tool_choice == "required"
    named = chat(
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get-time_2"}},
        parallel_tool_calls=False,
    )
    assert isinstance(named.tool_choice, NamedToolChoice)
    assert named.tool_choice.function.name == "get-time_2"
    assert named.parallel_tool_calls is False
    # "none" still shows the model the tools (vLLM's default): the prompt stays the same
    sent = chat(tools=[WEATHER], tool_choice="none").text_request("c", "api-0")
    assert sent.tools == [WEATHER]


def test_a_tool_round_trip_keeps_calls_and_results() -> None:
    msg = chat(messages=ROUND_TRIP, tools=[WEATHER]).text_request("c", "api-0")
    assert msg.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "22 C", "name": "get_weather", "tool_call_id": "call_1"},
    ]
    assert protocol.decode(protocol.encode(msg)) == msg


def test_a_tool_call_without_a_type_is_a_function_call() -> None:
    call = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
    msg = chat(messages=[{"role": "assistant", "tool_calls": [call]}]).text_request("c", "api-0")
    assert msg.messages is not None and msg.messages[0]["tool_calls"][0]["type"] == "function"


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tools": {"type": "function"}}, "tools", "valid array"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", ""),
        (
            {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
            "tools.0.function.name",
            "pattern",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
            "tools.0.function.name",
            "",
        ),
        ({"tools": [WEATHER, TIME, WEATHER]}, "tools", "tools.2: a second function named"),
        ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools.0.function.parameters",
            "an object",
        ),
        ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
        ({"tool_choice": "always"}, "tool_choice", "'none', 'auto', 'required'"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "tool_choice",
            "a named function needs tools",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            },
            "tool_choice",
            "names 'get_time', which is not among the tools (get_weather)",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function"}},
            "tool_choice.function",
            "required",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
        ({"function_call": "auto"}, "function_call", "use tool_choice"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs", "an object"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "set by the"),
        ({"chat_template_kwargs": {"a-b": 1}}, "chat_template_kwargs", "variable names"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
            "messages.0.tool_calls",
            "only assistant messages make tool calls",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]},
            "messages.0.tool_calls.0.function.name",
            "required",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
            "valid string",  # OpenAI's: JSON text
        ),
        (
            {"messages": [{"role": "tool", "content": "22", "tool_call_id": 1}]},
            "messages.0.tool_call_id",
            "valid string",
        ),
    ],
)
def test_tool_errors_name_the_field(fields: dict[str, Any], param: str, says: str) -> None:
    err = error_of(chat, **fields)
    assert err.param == param, err.message
    assert err.message.startswith(f"{param}: ") and says in err.message, err.message
