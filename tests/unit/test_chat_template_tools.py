"""Chat templates with tools (chat_messages, chat_template): Qwen3's real template renders
the definitions, earlier calls and their results, and takes enable_thinking; a Jinja
--chat-template file; LMDeploy's JSON refuses tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import transformers

from lmd.tokenizer.text.chat_template import (
    ChatMessage,
    ChatTemplateError,
    HfChatTemplate,
    LmdeployChatTemplate,
    load_chat_template,
    parse_messages,
    read_chat_template,
)
from tests.qwen3 import QWEN3_DIR
from tests.unit.test_chat_template import LMDEPLOY_EXAMPLE
from tests.unit.test_openai_tools import CALL, ROUND_TRIP, TIME, WEATHER

QWEN3_TOOLS = (  # Qwen3's system block with the tools (its template's own text)
    "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the "
    "user query.\n\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call><|im_end|>\n'
)


@pytest.fixture(scope="module")
def qwen3() -> HfChatTemplate:
    if not (QWEN3_DIR / "tokenizer.json").is_file():
        pytest.skip(f"Qwen3's tokenizer is not at {QWEN3_DIR}")
    return HfChatTemplate(transformers.AutoTokenizer.from_pretrained(QWEN3_DIR))


def tools_block(*tools: dict[str, Any]) -> str:
    # transformers' tojson: json.dumps with its default separators, keys in order
    return QWEN3_TOOLS.format(tools="\n".join(json.dumps(t) for t in tools))


def test_parse_keeps_tool_calls_with_their_arguments_as_an_object() -> None:
    parsed = parse_messages(ROUND_TRIP)
    assert parsed[1] == ChatMessage(
        "assistant",
        "",
        tool_calls=(
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
        ),
    )
    assert parsed[2] == ChatMessage("tool", "22 C", tool_call_id="call_1", name="get_weather")
    assert parsed[2].to_template() == {
        "role": "tool",
        "content": "22 C",
        "tool_call_id": "call_1",
        "name": "get_weather",
    }
    # arguments that are no JSON object stay the text they are
    text = {**CALL, "function": {"name": "f", "arguments": "not json"}}
    message = parse_messages([{"role": "assistant", "content": None, "tool_calls": [text]}])[0]
    assert message.tool_calls[0]["function"]["arguments"] == "not json"


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "only assistant messages"),
        ({"role": "assistant", "tool_calls": {"id": "c"}}, "must be a list of tool calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "tool_calls[0] must be"),
        ({"role": "tool", "content": "x", "tool_call_id": 5}, "tool_call_id must be a string"),
    ],
)
def test_bad_tool_messages_say_which(message: dict[str, Any], error: str) -> None:
    with pytest.raises(ChatTemplateError) as info:
        parse_messages([message])
    assert str(info.value).startswith("messages[0].") and error in str(info.value)


def test_qwen3_renders_the_tools_in_its_tools_block(qwen3: HfChatTemplate) -> None:
    prompt = qwen3.render(parse_messages(ROUND_TRIP[:1]), tools=[WEATHER, TIME])
    assert prompt == (
        tools_block(WEATHER, TIME)
        + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )
    without = qwen3.render(parse_messages(ROUND_TRIP[:1]))
    assert "<tools>" not in without and without.endswith("<|im_start|>assistant\n")


def test_qwen3_renders_an_earlier_call_and_its_result(qwen3: HfChatTemplate) -> None:
    prompt = qwen3.render(parse_messages(ROUND_TRIP), tools=[WEATHER])
    assert prompt == (
        tools_block(WEATHER) + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_renders_several_calls_of_one_turn(qwen3: HfChatTemplate) -> None:
    second = {**CALL, "id": "call_2", "function": {"name": "get-time_2", "arguments": "{}"}}
    chat = [
        ROUND_TRIP[0],
        {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL, second]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    ]
    prompt = qwen3.render(parse_messages(chat), tools=[WEATHER, TIME])
    assert prompt.endswith(
        "<|im_start|>assistant\nLet me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get-time_2", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_enable_thinking_reaches_qwen3s_template(qwen3: HfChatTemplate) -> None:
    chat = parse_messages(ROUND_TRIP[:1])
    off = qwen3.render(chat, template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = qwen3.render(chat, template_kwargs={"enable_thinking": True})
    assert on == qwen3.render(chat) and on.endswith("<|im_start|>assistant\n")


def test_a_final_assistant_message_with_calls_is_closed_not_continued(
    qwen3: HfChatTemplate,
) -> None:
    prompt = qwen3.render(parse_messages(ROUND_TRIP[:2]), tools=[WEATHER])
    assert prompt.endswith("</tool_call><|im_end|>\n<|im_start|>assistant\n")


def test_lmdeploy_templates_refuse_tools_and_tool_calls() -> None:
    template = LmdeployChatTemplate.from_dict(LMDEPLOY_EXAMPLE)
    with pytest.raises(ChatTemplateError, match="has no place for tools or tool calls"):
        template.render(parse_messages(ROUND_TRIP[:1]), tools=[WEATHER])
    with pytest.raises(ChatTemplateError, match="has no place for tools or tool calls"):
        template.render(parse_messages(ROUND_TRIP))
    # its tool role still renders a result, and variables are ignored (it has none)
    chat = parse_messages([ROUND_TRIP[0], ROUND_TRIP[2]])
    assert template.render(chat, template_kwargs={"enable_thinking": False}) == template.render(
        chat
    )


# --chat-template FILE: Jinja or LMDeploy's JSON ----------------------------------------

JINJA = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ greeting | default('assistant') }}:{% endif %}"
)


@pytest.mark.parametrize("name", ["t.jinja", "t.j2", "template.txt", "chat_template"])
def test_a_jinja_file_is_rendered_by_transformers(
    tmp_path: Path, smollm2_dir: Path, name: str
) -> None:
    path = tmp_path / name
    path.write_text(JINJA)
    assert read_chat_template(path) == JINJA
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    template = load_chat_template(path, tokenizer)
    assert isinstance(template, HfChatTemplate)
    chat = [ChatMessage("user", "Hi")]
    assert template.render(chat) == "user: Hi\nassistant:"
    assert template.render(chat, tools=[WEATHER, TIME], template_kwargs={"greeting": "bot"}) == (
        "TOOLS:get_weather;get-time_2;|user: Hi\nbot:"
    )


def test_a_json_file_is_lmdeploys_whatever_its_name(tmp_path: Path) -> None:
    for name in ("t.json", "t.conf"):
        path = tmp_path / name
        path.write_text(json.dumps(LMDEPLOY_EXAMPLE))
        assert read_chat_template(path) == LmdeployChatTemplate.from_dict(LMDEPLOY_EXAMPLE)


@pytest.mark.parametrize(
    ("name", "text", "error"),
    [
        ("bad.jinja", "{% for m in messages %}{{ m.content }}", "line 1: Unexpected end"),
        ("bad.j2", "hello\n{{ messages[0]. }}", "line 2: "),
        ("bad.txt", "{% if %}", "not a valid Jinja chat template: line 1: Expected an expression"),
        ("bad.json", "{% if %}", "not valid JSON"),  # named JSON: read as LMDeploy's
    ],
)
def test_a_template_that_does_not_parse_is_one_line_naming_the_file(
    tmp_path: Path, name: str, text: str, error: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ChatTemplateError) as info:
        read_chat_template(path)
    assert str(info.value).startswith(f"{path}: ") and error in str(info.value)
    assert "\n" not in str(info.value)


def test_a_template_file_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match=r"cannot read chat template .*No such file"):
        read_chat_template(tmp_path / "nope.jinja")
    path = tmp_path / "latin1.jinja"
    path.write_bytes(b"caf\xe9")
    with pytest.raises(ChatTemplateError, match="not UTF-8 text"):
        read_chat_template(path)
