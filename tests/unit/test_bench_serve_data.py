"""Prompts for `lmd-bench serve`: seeded, sized as asked, ShareGPT read defensively."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from lmd.bench.serve_data import (
    WORDS,
    random_prompts,
    shared_prefix_prompts,
    sharegpt_prompts,
    token_counter,
)


def test_random_prompts_are_seeded_and_sized() -> None:
    fixed = random_prompts(50, input_len=20, output_len=8, range_ratio=0.0, seed=1)
    assert all(len(p.text.split()) == p.input_len == 20 and p.output_len == 8 for p in fixed)
    assert len({p.text for p in fixed}) == 50  # no accidental shared prefixes
    assert fixed == random_prompts(50, 20, 8, 0.0, seed=1)
    assert fixed != random_prompts(50, 20, 8, 0.0, seed=2)
    ranged = random_prompts(400, input_len=100, output_len=10, range_ratio=0.5, seed=1)
    inputs = [p.input_len for p in ranged]
    assert min(inputs) >= 50 and max(inputs) <= 150 and max(inputs) - min(inputs) > 80
    assert all(len(p.text.split()) == p.input_len for p in ranged)
    assert {p.output_len for p in ranged} <= set(range(5, 16))


def test_a_word_is_one_token_for_smollm2(smollm2_dir: Path) -> None:
    count = token_counter(str(smollm2_dir))
    assert [count(f" {w}") for w in WORDS] == [1] * len(WORDS)
    assert all(count(p.text) == p.input_len for p in random_prompts(5, 64, 1, 0.0, seed=0))


def test_shared_prefix_groups() -> None:
    prompts = shared_prefix_prompts(6, num_prefixes=2, prefix_len=10, input_len=4,
                                    output_len=3, seed=0)  # fmt: skip
    heads = [" ".join(p.text.split()[:10]) for p in prompts]
    assert heads[0::2] == [heads[0]] * 3 and heads[1::2] == [heads[1]] * 3
    assert heads[0] != heads[1]
    assert len({p.text for p in prompts}) == 6
    assert all(p.input_len == 14 and len(p.text.split()) == 14 for p in prompts)


def _write(path: Path, data: object) -> Path:
    path.write_bytes(orjson.dumps(data))
    return path


def test_sharegpt_first_turns_with_answer_lengths(tmp_path: Path) -> None:
    good = {"conversations": [{"from": "human", "value": "Why is the sky blue?"},
                              {"from": "gpt", "value": "x" * 40}]}  # fmt: skip
    entries = [
        good,
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {
            "conversations": [
                {"from": "gpt", "value": "answer first"},
                {"from": "human", "value": "q"},
            ]
        },
        {"id": "no conversations"},
        "not even an object",
    ]
    path = _write(tmp_path / "sharegpt.json", entries)
    prompts = sharegpt_prompts(path, 3, None, token_counter(None), seed=0)
    assert [p.text for p in prompts] == ["Why is the sky blue?"] * 3  # cycled
    assert prompts[0].output_len == 10  # 40 characters at ~4 a token
    assert sharegpt_prompts(path, 1, 7, token_counter(None), seed=0)[0].output_len == 7


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"{not json", "cannot read"), (b'{"a": 1}', "JSON list"), (b"[]", "no conversation")],
)
def test_sharegpt_bad_files_say_what_is_wrong(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        sharegpt_prompts(path, 1, None, token_counter(None), seed=0)


def test_unloadable_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tokenizer"):
        token_counter(str(tmp_path))
