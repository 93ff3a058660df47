"""A request's bad_words as token ids (tokenizer/bad_words.py)."""

from __future__ import annotations

from lmd.api.openai_schema import ChatCompletionRequest
from lmd.tokenizer.bad_words import bad_word_ids

VOCAB = {"foo": [7], " foo": [8], "big dog": [3, 4], " big dog": [5, 4]}


def test_each_word_is_banned_as_written_and_after_a_space() -> None:
    ids = bad_word_ids(["foo", "big dog", " foo"], lambda text: VOCAB[text])
    assert ids == [[7], [8], [3, 4], [5, 4]]  # " foo" twice: once


def test_the_api_sends_penalties_bias_and_words_to_the_tokenizer() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "presence_penalty": 0.5,
        "frequency_penalty": -1.0,
        "logit_bias": {"12": 5.0, "7": -100.0},
        "bad_words": ["foo"],
    }
    sampling = ChatCompletionRequest.model_validate(body).sampling()
    assert sampling["presence_penalty"] == 0.5 and sampling["frequency_penalty"] == -1.0
    assert sampling["logit_bias"] == [[12, 5.0], [7, -100.0]]
    assert sampling["bad_words"] == ["foo"]
