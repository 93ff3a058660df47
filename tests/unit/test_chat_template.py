"""Chat templates: the exact prompt text the model sees, and template file errors."""

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
    parse_messages,
    read_chat_template,
)

# The example of LMDeploy's "Customized chat template" documentation.
LMDEPLOY_EXAMPLE = {
    "model_name": "your awesome chat template name",
    "system": "<|im_start|>system\n",
    "meta_instruction": "You are a robot developed by LMDeploy.",
    "eosys": "<|im_end|>\n",
    "user": "<|im_start|>user\n",
    "eoh": "<|im_end|>\n",
    "assistant": "<|im_start|>assistant\n",
    "eoa": "<|im_end|>",
    "separator": "\n",
    "capability": "chat",
    "stop_words": ["<|im_end|>"],
}
SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)
CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Capital of"}, {"type": "text", "text": "France?"}],
    },
]


@pytest.fixture(scope="session")
def smol(smollm2_dir: Path) -> HfChatTemplate:
    return HfChatTemplate(transformers.AutoTokenizer.from_pretrained(smollm2_dir))


@pytest.fixture
def lmdeploy() -> LmdeployChatTemplate:
    return LmdeployChatTemplate.from_dict(LMDEPLOY_EXAMPLE)


def test_messages_are_validated_and_flattened_to_text() -> None:
    assert parse_messages(CHAT) == [
        ChatMessage("user", "Hi"),
        ChatMessage("assistant", "Hello!"),
        ChatMessage("user", "Capital of\nFrance?"),
    ]
    assert parse_messages([{"role": "assistant", "content": None}]) == [
        ChatMessage("assistant", "")
    ]


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "messages must contain at least one message"),
        (
            [{"role": "robot", "content": "x"}],
            "messages[0].role must be one of system, user, assistant, tool, got 'robot'",
        ),
        (
            [{"role": "user", "content": None}],
            "messages[0].content must be a string or a list of text parts",
        ),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "image_url"}]},
            ],
            "messages[1].content[0] has type 'image_url': only {'type': 'text', 'text': ...} "
            "parts are supported by this text-only model",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            "messages[0].content[0].text must be a string",
        ),
    ],
)
def test_bad_messages_say_which_and_why(messages: list[Any], error: str) -> None:
    with pytest.raises(ChatTemplateError) as info:
        parse_messages(messages)
    assert str(info.value) == error


def test_lmdeploy_meta_instruction_goes_first_when_no_system_message(
    lmdeploy: LmdeployChatTemplate,
) -> None:
    assert lmdeploy.render(parse_messages(CHAT)) == (
        "<|im_start|>system\nYou are a robot developed by LMDeploy.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nCapital of\nFrance?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert lmdeploy.stop_words == ("<|im_end|>",)


def test_lmdeploy_system_message_replaces_meta_instruction() -> None:
    messages = [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hi"),
        ChatMessage("tool", "42"),
    ]
    plain = LmdeployChatTemplate.from_dict({**LMDEPLOY_EXAMPLE, "tool": "<t>", "eotool": "</t>"})
    assert plain.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<t>42</t>"
        "<|im_start|>assistant\n"
    )


def test_lmdeploy_final_assistant_message_is_continued(lmdeploy: LmdeployChatTemplate) -> None:
    messages = [ChatMessage("user", "Hi"), ChatMessage("assistant", "Well,")]
    assert lmdeploy.render(messages).endswith("<|im_start|>assistant\nWell,")
    assert lmdeploy.render(messages, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\nWell,<|im_end|>\n"
    )


def test_lmdeploy_fields_left_out_are_empty(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps({"model_name": "mini", "user": "U:", "assistant": "A:", "eoa": "\n"})
    )
    template = read_chat_template(path)
    assert isinstance(template, LmdeployChatTemplate)
    assert template.render(parse_messages(CHAT)) == "U:HiA:Hello!\nU:Capital of\nFrance?A:"
    assert template.stop_words == ()


def test_lmdeploy_completion_capability_passes_a_prompt_through() -> None:
    template = LmdeployChatTemplate.from_dict({**LMDEPLOY_EXAMPLE, "capability": "completion"})
    assert template.render_prompt("def f(") == "def f("
    chat = LmdeployChatTemplate.from_dict(LMDEPLOY_EXAMPLE)
    assert chat.render_prompt("Hi") == chat.render([ChatMessage("user", "Hi")])


def test_lmdeploy_interactive_turn_is_lmdeploy_s_get_prompt_after_the_first(
    lmdeploy: LmdeployChatTemplate,
) -> None:
    messages = parse_messages(CHAT)
    # What the session holds: turn 1's prompt and the reply, ended by its stop word.
    held = lmdeploy.render(messages[:1]) + "Hello!<|im_end|>"
    new = lmdeploy.render_increment(held, messages)
    # LMDeploy's get_prompt(prompt, sequence_start=False): separator, user turn, assistant.
    assert new == "\n<|im_start|>user\nCapital of\nFrance?<|im_end|>\n<|im_start|>assistant\n"
    assert held + new == lmdeploy.render(messages)
    closed = lmdeploy.render(messages[:2], add_generation_prompt=False)
    assert closed + lmdeploy.render_increment(closed, messages) == lmdeploy.render(messages)


def test_smollm2_template_renders_chatml_with_its_default_system(smol: HfChatTemplate) -> None:
    prompt = smol.render([ChatMessage("user", "What is the capital of France?")])
    assert prompt == (
        f"{SMOL_SYSTEM}<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert smol.stop_words == ()
    assert smol.render([ChatMessage("system", "S"), ChatMessage("user", "U")]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_final_assistant_message_is_continued(smol: HfChatTemplate) -> None:
    messages = [ChatMessage("user", "Hi"), ChatMessage("assistant", "Well,")]
    assert smol.render(messages) == (
        f"{SMOL_SYSTEM}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nWell,"
    )


def test_smollm2_interactive_turn_appends_only_the_new_text(smol: HfChatTemplate) -> None:
    messages = parse_messages(CHAT)
    held = smol.render(messages[:1]) + "Hello!<|im_end|>"
    new = smol.render_increment(held, messages)
    assert new == "\n<|im_start|>user\nCapital of\nFrance?<|im_end|>\n<|im_start|>assistant\n"
    assert held + new == smol.render(messages)
    closed = smol.render(messages[:2], add_generation_prompt=False)
    assert closed + smol.render_increment(closed, messages) == smol.render(messages)
    assert smol.render_increment("", messages) == smol.render(messages)


def test_history_the_template_renders_differently_is_refused(smollm2_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    # Like templates that mention the number of turns, or drop earlier reasoning.
    tokenizer.chat_template = (
        "{{ messages | length }} turns:{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    template = HfChatTemplate(tokenizer)
    messages = parse_messages(CHAT)
    held = template.render(messages[:2], add_generation_prompt=False)
    assert held == "2 turns:HiHello!"
    with pytest.raises(ChatTemplateError, match="start a new session with the whole conversation"):
        template.render_increment(held, messages)


def test_hf_template_errors_are_chat_template_errors(smollm2_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(
        ChatTemplateError, match="chat template rejected the chat: roles must alternate"
    ):
        HfChatTemplate(tokenizer).render([ChatMessage("user", "Hi")])
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template; give one with --chat-template"):
        HfChatTemplate(tokenizer)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (
            {"model_name": "m", "eos": "x"},
            "t.json: unknown field 'eos' (did you mean 'eosys'?); known fields: model_name, "
            "model_path, system, meta_instruction, eosys, user, eoh, assistant, eoa, tool, "
            "eotool, separator, capability, stop_words",
        ),
        (
            {"model_name": "m", "eoh": 3},
            "t.json: field 'eoh' must be a string or null, got 3 (int)",
        ),
        (
            {"model_name": "m", "stop_words": "<|im_end|>"},
            "t.json: field 'stop_words' must be a list of strings or null, got '<|im_end|>'",
        ),
        ({"system": "S"}, "t.json: field 'model_name' (a string) is required"),
        (
            {"model_name": "m", "capability": "vision"},
            "t.json: capability must be one of completion, infilling, chat, python, got 'vision'",
        ),
        (["model_name"], "t.json: expected a JSON object of template fields"),
    ],
)
def test_template_file_errors_name_the_file_and_the_field(
    tmp_path: Path, data: object, error: str
) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ChatTemplateError) as info:
        read_chat_template(path)
    assert str(info.value) == f"{tmp_path}/{error}"


def test_template_file_that_is_missing_or_not_json(tmp_path: Path) -> None:
    with pytest.raises(
        ChatTemplateError, match=r"cannot read chat template .*nope\.json: No such file"
    ):
        read_chat_template(tmp_path / "nope.json")
    path = tmp_path / "bad.json"
    path.write_text('{"model_name": "m",}')
    with pytest.raises(ChatTemplateError, match=r"bad\.json: not valid JSON: .*line 1 column 20"):
        read_chat_template(path)


def test_null_fields_take_the_default() -> None:
    template = LmdeployChatTemplate.from_dict({"model_name": "m", "user": None, "stop_words": None})
    assert template.user == "" and template.stop_words == ()
