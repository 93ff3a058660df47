"""Which parsers read a chat request's reply (api/parsers/choice.py): the config's
flags, the model's chat template, and the request's tools, tool_choice and
chat_template_kwargs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from lmd.api.openai_schema import ChatCompletionRequest
from lmd.api.parsers.choice import ReplyChoice, model_template_text
from lmd.api.parsers.reasoning import DEEPSEEK_R1, QWEN3
from lmd.api.parsers.reply import ReplyParser
from lmd.api.parsers.tool_calls import HERMES, LLAMA3_JSON, MISTRAL, REQUIRED
from lmd.config import ConfigError, ServeConfig
from tests.qwen3 import qwen3_template

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def body(**extra: Any) -> ChatCompletionRequest:
    fields = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return ChatCompletionRequest.model_validate_json(orjson.dumps(fields))


def choice(tmp_path: Path, **config: Any) -> ReplyChoice:
    return ReplyChoice(ServeConfig(runtime_dir=tmp_path, **config))


async def test_a_plain_request_without_a_reasoning_parser_is_not_parsed(tmp_path: Path) -> None:
    replies = choice(tmp_path, tool_call_parser="hermes")
    assert await replies.for_chat(body()) is None
    assert await replies.for_chat(body(tools=[TOOL], tool_choice="none")) is None


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        (None, ReplyParser(tools=MISTRAL)),  # auto: the model's format
        ("auto", ReplyParser(tools=MISTRAL)),
        ("required", ReplyParser(tools=REQUIRED)),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            ReplyParser(function="get_weather"),
        ),
    ],
)
async def test_tool_choice_picks_the_tool_parser(
    tmp_path: Path, tool_choice: Any, expected: ReplyParser
) -> None:
    replies = choice(tmp_path, tool_call_parser="mistral")
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    assert await replies.for_chat(body(tools=[TOOL], **extra)) == expected


async def test_reasoning_applies_to_every_reply_but_constrained_ones(tmp_path: Path) -> None:
    replies = choice(tmp_path, tool_call_parser="hermes", reasoning_parser="qwen3")
    assert await replies.for_chat(body()) == ReplyParser(think=QWEN3, opened=None)
    with_tools = await replies.for_chat(body(tools=[TOOL]))
    assert with_tools == ReplyParser(think=QWEN3, opened=None, tools=HERMES)
    # JSON only: no <think> to split
    assert await replies.for_chat(body(tools=[TOOL], tool_choice="required")) == ReplyParser(
        tools=REQUIRED
    )
    assert await replies.for_chat(body(response_format={"type": "json_object"})) is None


async def test_enable_thinking_false_says_the_prompt_opened_none(tmp_path: Path) -> None:
    replies = choice(tmp_path, reasoning_parser="deepseek_r1")
    assert (await replies.for_chat(body())) == ReplyParser(think=DEEPSEEK_R1, opened=True)
    off = body(chat_template_kwargs={"enable_thinking": False})
    assert (await replies.for_chat(off)) == ReplyParser(think=DEEPSEEK_R1, opened=False)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '[TOOL_CALLS]' }}", MISTRAL),
        ("{{ '<|python_tag|>' }}", LLAMA3_JSON),
        ("{{ messages }}", HERMES),
    ],
)
async def test_auto_reads_the_format_from_the_chat_template_once(
    tmp_path: Path, template: str, expected: Any
) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(template)
    replies = choice(tmp_path, chat_template=str(path))
    assert (await replies.for_chat(body(tools=[TOOL]))) == ReplyParser(tools=expected)
    path.unlink()  # read once: the answer stays
    assert await replies.tool_format() is expected


async def test_an_unreadable_template_falls_back_to_hermes(tmp_path: Path) -> None:
    replies = choice(tmp_path, chat_template=str(tmp_path / "gone.jinja"))
    assert await replies.tool_format() is HERMES


def test_qwen3s_model_directory_names_hermes(tmp_path: Path) -> None:
    template = qwen3_template()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert model_template_text(tmp_path) == template
    named = [{"name": "default", "template": "a"}, {"name": "tool_use", "template": "<tool_call>"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert "<tool_call>" in model_template_text(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("[TOOL_CALLS]")  # takes precedence
    assert model_template_text(tmp_path) == "[TOOL_CALLS]"
    assert model_template_text(tmp_path / "none") == ""


def test_bad_parser_names_are_one_line_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tool_call_parser: 'x' is not one of auto, hermes"):
        ServeConfig(runtime_dir=tmp_path, tool_call_parser="x")
    with pytest.raises(ConfigError, match="reasoning_parser: 'r1' is not one of deepseek_r1"):
        ServeConfig(runtime_dir=tmp_path, reasoning_parser="r1")
