"""The tokenizer process's prompts (tokenizer/prompts.py): a request's prompt ids, and the
answers to /tokenize and /detokenize, on SmolLM2's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers

from lmd import protocol
from lmd.tokenizer.prompts import Prompts
from lmd.tokenizer.text.chat_template import HfChatTemplate
from tests.unit.test_chat_template_tools import JINJA
from tests.unit.test_openai_tools import ROUND_TRIP, WEATHER

SESSION_LEN = 2048


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer: transformers.PreTrainedTokenizerBase) -> Prompts:
    template = HfChatTemplate(tokenizer, JINJA)  # one that renders tools
    return Prompts(tokenizer, template, len(tokenizer), SESSION_LEN)


def chat_request(**fields: Any) -> protocol.TextRequest:
    return protocol.TextRequest(
        "chatcmpl-1", "api-0", ROUND_TRIP[:1], None, {}, [], True, b"", **fields
    )


def test_a_chat_request_renders_its_tools_and_variables(prompts: Prompts) -> None:
    plain = prompts.of_request(chat_request())
    assert prompts.tokenizer.decode(plain) == "user: Weather in Paris?\nassistant:"
    tooled = prompts.of_request(
        chat_request(tools=[WEATHER], chat_template_kwargs={"greeting": "bot"})
    )
    assert prompts.tokenizer.decode(tooled) == "TOOLS:get_weather;|user: Weather in Paris?\nbot:"


def test_tokenize_a_prompt_or_a_chat(
    prompts: Prompts, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    text = protocol.Tokenize("t1", "api-0", "Hello world", None, True, True, True)
    answer = prompts.tokenize(text)
    ids = protocol.unpack_ids(answer.token_ids)
    assert ids == tokenizer("Hello world")["input_ids"]
    assert answer.token_strs == tokenizer.convert_ids_to_tokens(ids) == ["Hello", "Ġworld"]
    assert answer.max_model_len == SESSION_LEN and answer.text == ""
    assert protocol.decode(protocol.encode(answer)) == answer
    chat = protocol.Tokenize(
        "t2", "api-0", None, ROUND_TRIP[:1], False, False, False, [WEATHER], None
    )
    answer = prompts.tokenize(chat)
    assert answer.token_strs is None
    rendered = "TOOLS:get_weather;|user: Weather in Paris?\n"  # no generation prompt
    assert protocol.unpack_ids(answer.token_ids) == prompts.encode(rendered)


def test_detokenize_and_the_vocabulary_check(prompts: Prompts) -> None:
    ids = prompts.encode("The capital of France")
    answer = prompts.detokenize(protocol.Detokenize("t3", "api-0", protocol.pack_ids(ids)))
    assert answer.text == "The capital of France" and answer.token_ids == b""
    assert prompts.detokenize(protocol.Detokenize("t4", "api-0", b"")).text == ""
    past = protocol.pack_ids([1, prompts.vocab_size])
    with pytest.raises(ValueError, match=f"token id {prompts.vocab_size} is outside the vocab"):
        prompts.detokenize(protocol.Detokenize("t5", "api-0", past))
    request = protocol.TextRequest("c", "api-0", None, None, {}, [], True, past)
    with pytest.raises(ValueError, match=r"prompt token id \d+ is outside the vocabulary"):
        prompts.of_request(request)
