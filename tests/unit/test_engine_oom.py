"""An allocation that fails inside a step costs that step's requests, not the engine
(engine.py, StepOutOfMemory): their blocks are freed and the engine steps on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.memory_plan import StepOutOfMemory
from lmd.engine.sequence import SamplingParams, Sequence
from tests.models import save_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def make_engine(model_dir: Path, overlap: bool, mixed: int = 0) -> Engine:
    config = EngineConfig(
        block_size=16, cache_max_entry_count=64, overlap_steps=overlap, mixed_prefill_tokens=mixed
    )
    return Engine.build(model_dir, config)


def fail_forward_at(engine: Engine, calls: set[int]) -> None:
    """The backend's forward raises CUDA's out-of-memory error on these calls (1-based)."""
    forward: Callable[..., Any] = engine.backend.forward
    count = 0

    def failing(*args: Any) -> Any:
        nonlocal count
        count += 1
        if count in calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        return forward(*args)

    engine.backend.forward = failing  # type: ignore[method-assign,assignment]


def drive(engine: Engine, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], list[str]]:
    """Run to the end; tokens per request and the requests a failed step took."""
    for rid, prompt in prompts.items():
        engine.add(Sequence(rid, prompt, GREEDY))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    failed: list[str] = []
    while engine.has_work:
        try:
            events = engine.step()
        except StepOutOfMemory as exc:
            assert "Tried to allocate 64.00 MiB" in str(exc)
            failed += exc.request_ids
            continue
        for event in events:
            tokens.setdefault(event.request_id, []).append(event.token_id)
    return tokens, failed


PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12], "c": [13, 14, 15, 16]}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_decode_step_fails_its_requests_frees_their_blocks_and_the_engine_serves_on(
    model_dir: Path, overlap: bool
) -> None:
    reference, _ = drive(make_engine(model_dir, overlap), PROMPTS)
    engine = make_engine(model_dir, overlap)
    fail_forward_at(engine, {4})  # a decode step of all three (prefill was call 1)
    tokens, failed = drive(engine, PROMPTS)
    assert sorted(failed) == ["a", "b", "c"]
    for rid in PROMPTS:
        assert tokens[rid] == reference[rid][: len(tokens[rid])]
        assert len(tokens[rid]) < len(reference[rid])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    # and the next requests get every token, the same ones
    after, failed = drive(engine, PROMPTS)
    assert failed == [] and after == reference


def test_a_failed_prefill_step_fails_only_the_prompts_in_it(model_dir: Path) -> None:
    reference, _ = drive(make_engine(model_dir, False), {"x": [3, 4, 5]})
    engine = make_engine(model_dir, False)
    engine.add(Sequence("x", [3, 4, 5], GREEDY))
    engine.step()  # x prefilled and decoding
    fail_forward_at(engine, {2})  # the step after the next: the prefill of y and z
    engine.step()
    tokens, failed = drive(engine, {"y": [20, 21], "z": [22, 23, 24]})
    assert sorted(failed) == ["y", "z"]
    assert tokens["y"] == tokens["z"] == []
    assert tokens["x"] == reference["x"][2:]  # x (in no failed step) got all of its own
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert engine.decode.num_running == 0  # x ran to its end
    assert len(reference["x"]) == GREEDY.max_tokens


def test_a_failed_mixed_step_fails_the_decoding_rows_in_it_too(model_dir: Path) -> None:
    engine = make_engine(model_dir, False, mixed=16)
    engine.add(Sequence("x", [3, 4, 5], GREEDY))
    engine.step()  # x prefilled and decoding
    fail_forward_at(engine, {2})  # the step after the next: x's row with y's and z's prompts
    engine.step()
    tokens, failed = drive(engine, {"y": [20, 21], "z": [22, 23, 24]})
    assert sorted(failed) == ["x", "y", "z"]
    assert tokens["y"] == tokens["z"] == []
    assert engine.num_mixed_steps == 0  # the one mixed step failed
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert not engine.has_work
