"""Which tokenizer worker an api worker hands each request to (api/tokenizers.py)."""

from __future__ import annotations

from pathlib import Path

from lmd.api.tokenizers import TokenizerChoice
from lmd.config import ServeConfig


def config(**values: object) -> ServeConfig:
    return ServeConfig(model="m", runtime_dir=Path("/nonexistent"), **values)  # type: ignore[arg-type]


def test_requests_go_to_the_running_tokenizers_in_turn() -> None:
    choice = TokenizerChoice(config(tokenizer_workers=3))
    assert [choice.pick() for _ in range(4)] == [
        "tokenizer-0", "tokenizer-1", "tokenizer-2", "tokenizer-0",
    ]  # fmt: skip
    choice.update({"tokenizer-0": 1, "tokenizer-2": 3, "hybrid-0": 4})  # tokenizer-1 restarts
    assert {choice.pick() for _ in range(4)} == {"tokenizer-0", "tokenizer-2"}


def test_a_session_stays_on_one_tokenizer_even_while_it_restarts() -> None:
    choice = TokenizerChoice(config(tokenizer_workers=2))
    assert [choice.pick(session_id=s) for s in (4, 5, 4)] == [
        "tokenizer-0", "tokenizer-1", "tokenizer-0",
    ]  # fmt: skip
    choice.update({"tokenizer-0": 1})
    assert choice.pick(session_id=5) == "tokenizer-1"  # its history is there: a 503, not a move


def test_a_cluster_node_without_a_tokenizer_uses_the_cluster_s() -> None:
    choice = TokenizerChoice(config())
    choice.configured = []  # as worker_names gives a node whose --roles leave it out
    choice.update({"tokenizer-0@a": 1, "tokenizer-1@a": 2, "decode-0@b": 3})
    assert {choice.pick() for _ in range(2)} == {"tokenizer-0@a", "tokenizer-1@a"}
    assert choice.pick(session_id=3) == "tokenizer-1@a"
