"""OpenAI's frequency penalty and logit_bias, and vLLM's bad_words, through the daemon on
SmolLM2 (greedy): each changes the answer the way its definition says."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from lmd.engine.model_source import resolve_model
from tests.integration.openai_api.shared_daemon import MODEL, QUESTION


def answer(client: openai.OpenAI, **extra: Any) -> str:
    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 24, **extra}
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, **settings)
    return reply.choices[0].message.content or ""


def test_bad_words_and_logit_bias_keep_a_word_out_and_force_a_token(client: openai.OpenAI) -> None:
    plain = answer(client)
    assert "Paris" in plain
    assert "Paris" not in answer(client, extra_body={"bad_words": ["Paris"]})
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    paris = tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    assert len(paris) == 1
    banned = answer(client, logit_bias={str(paris[0]): -100})
    assert " Paris" not in banned
    bang = tokenizer("!", add_special_tokens=False)["input_ids"][0]
    assert answer(client, logit_bias={str(bang): 100}, max_tokens=5) == "!!!!!"


def test_a_frequency_penalty_stops_a_repetition(client: openai.OpenAI) -> None:
    def text(**extra: Any) -> str:
        settings: dict[str, Any] = {"temperature": 0, "max_tokens": 16, **extra}
        reply = client.completions.create(model=MODEL, prompt="1 1 1 1 1 1 1 1 1 1", **settings)
        return str(reply.choices[0].text)

    plain = text().split()
    assert set(plain) == {"1"} and len(plain) >= 6  # greedy SmolLM2 goes on repeating
    # -2 per repeat: the run stops after a few (a flat presence_penalty of 2 does not
    # outweigh SmolLM2's margin here; test_penalties.py checks its formula)
    penalized = text(frequency_penalty=2.0).split()
    assert penalized.count("1") < len(plain) / 2, penalized


@pytest.mark.parametrize(
    ("bias", "says"),
    [
        ({"x": 1}, "keys must be token ids"),
        ({"5": 101}, "[-100, 100]"),
        ({"999999": 1}, "999999 is outside this model's vocabulary"),
    ],
)
def test_bad_logit_bias_is_400(client: openai.OpenAI, bias: dict[str, int], says: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        answer(client, logit_bias=bias)
    assert says in exc.value.message
