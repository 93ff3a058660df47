"""Overlapped decode steps (engine.py): step N+1 launched before step N is read back.

On the CPU the device work is not asynchronous, but the bookkeeping is the same as on
CUDA: tokens fed from the previous step's output tensor, counts one ahead in the sampler,
rows of finished sequences dropped, blocks freed only once no step in flight holds them.
Every test compares against the same engine with overlap off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.events import TokenEvent
from lmd.engine.sequence import FinishReason, SamplingParams, Sequence
from tests.models import random_prompts, save_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def make_engine(model_dir: Path, overlap: bool, **overrides: Any) -> Engine:
    settings: dict[str, Any] = {"block_size": 16, "cache_max_entry_count": 256}
    settings.update(overrides)
    return Engine.build(model_dir, EngineConfig(overlap_steps=overlap, **settings))


def event_key(e: TokenEvent) -> tuple[Any, ...]:
    lp = None if e.logprobs is None else (e.logprobs.token_id, round(e.logprobs.logprob, 4))
    return (e.token_id, e.finish_reason, e.position, lp)


def run(
    engine: Engine,
    requests: list[tuple[list[int], SamplingParams]],
    *,
    join_at: dict[int, int] | None = None,
    abort_at: dict[int, int] | None = None,
) -> dict[str, list[tuple[Any, ...]]]:
    """Every request's events; request i joins before step join_at[i] (default 0) and
    is aborted before step abort_at[i]."""
    join_at, abort_at = join_at or {}, abort_at or {}
    out: dict[str, list[tuple[Any, ...]]] = {f"r{i}": [] for i in range(len(requests))}
    step = 0
    while True:
        for i, (prompt, params) in enumerate(requests):
            if join_at.get(i, 0) == step:
                engine.add(Sequence(f"r{i}", prompt, params))
            if abort_at.get(i) == step:
                engine.abort(f"r{i}")
        if not engine.has_work and step >= max([*join_at.values(), *abort_at.values(), 0]):
            break
        for event in engine.step():
            out[event.request_id].append(event_key(event))
        step += 1
        assert step < 1000
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    return out


def both(model_dir: Path, requests: list[tuple[list[int], SamplingParams]], **kw: Any) -> Engine:
    """Run `requests` with and without overlap; assert the same events; the overlapped one."""
    plain = make_engine(model_dir, False)
    expected = run(plain, requests, **kw)
    assert plain.num_ahead_steps == 0
    overlapped = make_engine(model_dir, True)
    assert run(overlapped, requests, **kw) == expected
    return overlapped


def test_mixed_sampling_gives_the_same_events_with_steps_run_ahead(model_dir: Path) -> None:
    prompts = random_prompts([5, 17, 33, 64, 70], seed=21)
    probe = make_engine(model_dir, False)
    greedy_out = run(probe, [(prompts[3], GREEDY)])["r0"]
    stop_id = greedy_out[6][0]  # a token greedy decoding meets after min_new_tokens
    requests = [
        (prompts[0], GREEDY),
        (prompts[1], SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=15)),
        (prompts[2], SamplingParams(temperature=1.0, top_k=5, seed=3, logprobs=2, max_tokens=9)),
        (prompts[3], SamplingParams(temperature=0.0, stop_token_ids=(stop_id,), min_new_tokens=3)),
        (prompts[4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)),
    ]
    engine = both(model_dir, requests)
    assert engine.num_ahead_steps > 5


def test_stop_token_ends_a_sequence_while_its_next_step_runs_ahead(model_dir: Path) -> None:
    prompt = random_prompts([40], seed=22)[0]
    greedy_out = run(make_engine(model_dir, False), [(prompt, GREEDY)])["r0"]
    stop_id = greedy_out[4][0]
    params = SamplingParams(temperature=0.0, stop_token_ids=(stop_id,), max_tokens=20)
    engine = make_engine(model_dir, True)
    events = run(engine, [(prompt, params), (prompt, GREEDY)])
    first_stop = next(i for i, e in enumerate(greedy_out) if e[0] == stop_id)
    assert len(events["r0"]) == first_stop + 1 and events["r0"][-1][1] == FinishReason.STOP
    assert len(events["r1"]) == 20  # the other request ran on, ahead, after r0 ended
    assert engine.num_ahead_steps > 0


def test_requests_joining_and_aborted_mid_run(model_dir: Path) -> None:
    prompts = random_prompts([12, 30, 45, 8], seed=23)
    requests = [(p, GREEDY) for p in prompts]
    joins = {2: 5, 3: 9}
    whole = run(make_engine(model_dir, False), requests, join_at=joins)
    engine = make_engine(model_dir, True)
    cut = run(engine, requests, join_at=joins, abort_at={1: 7, 3: 12})
    assert cut["r0"] == whole["r0"] and cut["r2"] == whole["r2"]
    # An aborted request's tokens so far: a step's tokens come out one call later here.
    for r in ("r1", "r3"):
        assert 0 < len(cut[r]) < len(whole[r]) and cut[r] == whole[r][: len(cut[r])]
    assert engine.num_ahead_steps > 0


def test_a_repetition_penalty_samples_once_the_token_in_flight_is_back(model_dir: Path) -> None:
    """Its forward runs ahead; its sampling waits for the token before (same events)."""
    prompts = random_prompts([10, 20], seed=24)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=12)
    engine = both(model_dir, [(p, params) for p in prompts])
    assert engine.num_ahead_steps > 0


def test_overlap_defaults_to_the_device_kind(model_dir: Path) -> None:
    assert not Engine.build(model_dir, EngineConfig(cache_max_entry_count=16)).overlap
    with pytest.raises(ValueError, match="overlap_steps"):
        EngineConfig(overlap_steps="yes")  # type: ignore[arg-type]
