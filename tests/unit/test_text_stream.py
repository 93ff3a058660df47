from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer

from lmd.tokenizer.text.stream import TextStream
from lmd.tokenizer.text.token_bytes import TokenBytes

TEXT = "The capital of France is Paris. It is lovely in spring. 🌷"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    backend: Tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir).backend_tokenizer
    return backend


def token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    assert found is not None, token
    return found


def run(stream: TextStream, ids: list[int], last_reason: str = "length") -> tuple[str, str | None]:
    text = ""
    for i, token in enumerate(ids):
        update = stream.feed(token, last_reason if i == len(ids) - 1 else None)
        text += update.text
        if update.finish_reason is not None:
            return text, update.finish_reason
    return text, None


def test_text_of_all_tokens_and_the_engine_finish_reason(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    stream = TextStream(tokenizer, prompt_ids=[1, 2, 3])
    assert run(stream, ids) == (TEXT, "length")
    assert (stream.num_prompt_tokens, stream.num_completion_tokens) == (3, len(ids))
    assert stream.feed(5, None).text == ""  # finished: nothing more


def test_stop_string_ends_the_request_and_is_not_in_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    stream = TextStream(tokenizer, prompt_ids=[1], stops=["Paris", "spring"])
    updates = [stream.feed(t, None) for t in ids]
    assert "".join(u.text for u in updates) == "The capital of France is "
    stopped = [u for u in updates if u.stopped_by_string]
    assert len(stopped) == 1 and stopped[0].finish_reason == "stop"
    assert stream.num_completion_tokens == ids.index(token_id(tokenizer, "ĠParis")) + 1


def test_a_stop_completed_only_by_the_last_token_is_still_caught(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three", add_special_tokens=False).ids
    stream = TextStream(tokenizer, prompt_ids=[1], stops=["three"])
    assert run(stream, ids, last_reason="length") == ("one two ", "stop")


def test_special_tokens_are_skipped_unless_asked(tokenizer: Tokenizer) -> None:
    end = token_id(tokenizer, "<|im_end|>")
    ids = [*tokenizer.encode("Hi there", add_special_tokens=False).ids, end]
    assert run(TextStream(tokenizer, prompt_ids=[1]), ids, "stop") == ("Hi there", "stop")
    keep = TextStream(tokenizer, prompt_ids=[1], skip_special_tokens=False)
    assert run(keep, ids, "stop") == ("Hi there<|im_end|>", "stop")


def test_logprobs_name_the_tokens(tokenizer: Tokenizer) -> None:
    paris, london = token_id(tokenizer, "ĠParis"), token_id(tokenizer, "ĠLondon")
    stream = TextStream(tokenizer, prompt_ids=[1], token_bytes=TokenBytes(tokenizer))
    update = stream.feed(paris, None, {"logprob": -0.25, "top": [[paris, -0.25], [london, -2.0]]})
    assert update.logprobs == [
        {
            "token": " Paris",
            "logprob": -0.25,
            "bytes": list(b" Paris"),
            "top": [[" Paris", -0.25, list(b" Paris")], [" London", -2.0, list(b" London")]],
        }
    ]


def test_logprob_bytes_of_a_split_character_join_to_its_utf8(tokenizer: Tokenizer) -> None:
    """🎉 is three tokens here; each alone decodes to U+FFFD, yet their bytes join."""
    ids = tokenizer.encode("🎉", add_special_tokens=False).ids
    assert len(ids) > 1
    stream = TextStream(tokenizer, prompt_ids=[1], token_bytes=TokenBytes(tokenizer))
    entries = [stream.feed(i, None, {"logprob": -0.5, "top": [[i, -0.5]]}).logprobs for i in ids]
    joined = b"".join(bytes(e["bytes"]) for entry in entries for e in entry or [])
    assert joined == "🎉".encode()
    assert all(e["top"][0][2] == e["bytes"] for entry in entries for e in entry or [])
