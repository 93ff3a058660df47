"""Structured output fields (guided.py): what each becomes in the engine's
sampling["guided"], and the 400s for constraints xgrammar cannot compile."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from lmd import protocol
from lmd.api.guided import choice_regex, problem
from lmd.api.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest
from tests.unit.test_openai_schema import MODEL, error_of
from tests.unit.test_openai_tools import TIME, WEATHER

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
GRAMMAR = 'root ::= "yes" | "no"'
jsonschema = pytest.importorskip("jsonschema")


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def completion(**fields: Any) -> CompletionRequest:
    body = {"model": MODEL, "prompt": "Answer:", **fields}
    return CompletionRequest.model_validate_json(json.dumps(body))


def guided(req: ChatCompletionRequest | CompletionRequest) -> Any:
    return req.sampling().get("guided")


def json_schema(schema: Any = None, **more: Any) -> dict[str, Any]:
    inner = {"name": "person", **({} if schema is None else {"schema": schema}), **more}
    return {"type": "json_schema", "json_schema": inner}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ["json", ""]),
        ({"response_format": json_schema(PERSON, strict=True)}, ["json", PERSON]),
        ({"response_format": json_schema()}, ["json", ""]),  # no schema: any JSON object
        (
            {"response_format": {"type": "regex_schema", "regex_schema": "[0-9]{3}"}},
            ["regex", "[0-9]{3}"],
        ),
        ({"guided_json": PERSON}, ["json", PERSON]),
        ({"guided_json": json.dumps(PERSON)}, ["json", PERSON]),  # vLLM takes it as text too
        ({"guided_regex": "\\d+"}, ["regex", "\\d+"]),
        ({"guided_grammar": GRAMMAR}, ["grammar", GRAMMAR]),
        ({"guided_choice": ["yes", "no"]}, ["regex", "(yes|no)"]),
    ],
)
def test_each_field_maps_to_the_engine_s_guided(
    fields: dict[str, Any], expected: list[Any] | None
) -> None:
    for req in (chat(**fields), completion(**fields)):
        got = guided(req)
        if expected is not None and expected[0] == "json" and expected[1]:
            assert got[0] == "json" and json.loads(got[1]) == expected[1]
        else:
            assert got == expected
        msg = req.text_request("r", "api-0")
        assert protocol.decode(protocol.encode(msg)) == msg


def test_guided_choice_matches_exactly_its_choices_taken_literally() -> None:
    choices = ["a.b", "(x)", "1+1=2?", "c|d", "[e]", "\\", "f{2}", "^$"]
    pattern = choice_regex(choices)
    for choice in choices:
        assert re.fullmatch(pattern, choice)
    for other in ["aXb", "x", "11=2", "c", "e", "ff", ""]:
        assert not re.fullmatch(pattern, other)
    assert problem("regex", pattern) is None  # xgrammar compiles it (None without xgrammar)


def test_tool_choice_required_is_an_array_of_calls_to_the_given_tools() -> None:
    tools = [WEATHER, TIME]
    kind, text = guided(chat(tools=tools, tool_choice="required"))
    schema = json.loads(text)
    assert kind == "json"
    ok = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "get-time_2", "parameters": {}},
    ]
    jsonschema.validate(ok, schema)
    bad = [
        [],  # at least one call
        [{"name": "get_weather", "parameters": {}}],  # city is required
        [{"name": "launch", "parameters": {}}],  # not a given tool
        [{"name": "get-time_2"}],  # parameters are required
    ]
    for calls in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    one = json.loads(
        guided(chat(tools=tools, tool_choice="required", parallel_tool_calls=False))[1]
    )
    jsonschema.validate(ok[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, one)  # one call only


def test_a_named_tool_constrains_the_output_to_its_arguments() -> None:
    name = {"type": "function", "function": {"name": "get_weather"}}
    kind, text = guided(chat(tools=[TIME, WEATHER], tool_choice=name))
    assert kind == "json" and json.loads(text) == WEATHER["function"]["parameters"]
    name = {"type": "function", "function": {"name": "get-time_2"}}
    assert guided(chat(tools=[TIME, WEATHER], tool_choice=name)) == ["json", '{"type":"object"}']
    # "auto" and "none" constrain nothing, and leave response_format its say
    assert guided(chat(tools=[WEATHER], response_format={"type": "json_object"})) == ["json", ""]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "type 'json_schema' needs the json_schema field",
        ),
        ({"response_format": {"type": "regex_schema"}}, "response_format", "regex_schema field"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'json_object'"),
        ({"response_format": json_schema(schema=[1])}, "response_format.json_schema.schema", ""),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
            "response_format.json_schema.name",
            "required",
        ),
        ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json", "a JSON schema object"),
        ({"guided_json": 5}, "guided_json", ""),
        ({"guided_regex": ""}, "guided_regex", "at least 1 character"),
        ({"guided_choice": []}, "guided_choice", "at least 1 item"),
        ({"guided_choice": ["a", ""]}, "guided_choice.1", ""),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "response_format constrains the output already",
        ),
        (
            {"guided_json": PERSON, "guided_choice": ["a"]},
            "guided_choice",
            "guided_json constrains the output already",
        ),
    ],
)
def test_constraint_errors_name_the_field(fields: dict[str, Any], param: str, says: str) -> None:
    for make in (chat, completion):
        err = error_of(make, **fields)
        assert err.param == param, err.message
        assert says in err.message, err.message


def test_required_tools_and_another_constraint_is_a_400() -> None:
    err = error_of(
        chat, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}
    )
    assert err.param == "tool_choice" and "as response_format does" in err.message
    # response_format text constrains nothing
    chat(tools=[WEATHER], tool_choice="required", response_format={"type": "text"})


# Compiled with xgrammar before admission -------------------------------------------------


async def error_of_check(req: ChatCompletionRequest | CompletionRequest) -> ApiError | None:
    pytest.importorskip("xgrammar")
    try:
        await req.check()
    except ApiError as err:
        assert err.status == 400 and err.message.startswith(f"{err.param}: ")
        return err
    return None


async def test_constraints_xgrammar_compiles_are_admitted() -> None:
    for fields in (
        {"response_format": json_schema(PERSON)},
        {"response_format": {"type": "json_object"}},
        {"guided_regex": "[a-z]+@[a-z]+\\.com"},
        {"guided_grammar": GRAMMAR},
        {"guided_choice": ["a.b", "(x)"]},
        {"tools": [WEATHER, TIME], "tool_choice": "required"},
    ):
        assert await error_of_check(chat(**fields)) is None, fields


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {"response_format": json_schema({"type": "wat"})},
            "response_format.json_schema.schema",
            "wat",
        ),
        ({"guided_json": {"$ref": "#/nowhere"}}, "guided_json", "nowhere"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "parenthesis is not closed"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF"),
        (
            {"response_format": {"type": "regex_schema", "regex_schema": "[z-a]"}},
            "response_format.regex_schema",
            "",
        ),
    ],
)
async def test_constraints_xgrammar_refuses_are_a_400_naming_the_field(
    fields: dict[str, Any], param: str, says: str
) -> None:
    for req in (chat(**fields), completion(**fields)):
        err = await error_of_check(req)
        assert err is not None and err.param == param, fields
        assert says in err.message and "/project/" not in err.message, err.message


async def test_a_tool_s_bad_parameters_are_named_by_tool() -> None:
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "wat"}}}
    err = await error_of_check(chat(tools=[WEATHER, bad], tool_choice="required"))
    assert err is not None and err.param == "tools.1.function.parameters"
    named = {"type": "function", "function": {"name": "bad"}}
    err = await error_of_check(chat(tools=[WEATHER, bad], tool_choice=named))
    assert err is not None and err.param == "tools.1.function.parameters"
    # "auto" compiles nothing: the tool's schema only describes it to the model
    assert await error_of_check(chat(tools=[WEATHER, bad])) is None
