from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmd.config import ConfigError, ServeConfig
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.fixed_engine import FixedTokenEngine, FixedTokens
from lmd.engine.sequence import FinishReason, SamplingParams, Sequence
from tests.models import TINY_EOS, save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def new_engine(model_dir: Path, session_len: int | None = None) -> FixedTokenEngine:
    return FixedTokenEngine(FixedTokens(model_dir), EngineConfig(session_len=session_len))


def test_each_step_gives_every_running_request_one_token(model_dir: Path) -> None:
    engine = new_engine(model_dir)
    engine.add(Sequence("a", [5, 6], SamplingParams(max_tokens=3)))
    engine.add(Sequence("b", [9], SamplingParams(max_tokens=1)))
    first = engine.step()
    assert [(e.request_id, e.position, e.finish_reason) for e in first] == [
        ("a", 0, None),
        ("b", 0, FinishReason.LENGTH),
    ]
    engine.add(Sequence("c", [7], SamplingParams(max_tokens=2)))  # joins mid-run
    second = engine.step()
    assert [(e.request_id, e.position) for e in second] == [("a", 1), ("c", 0)]
    third = engine.step()
    assert [(e.request_id, e.finish_reason) for e in third] == [
        ("a", FinishReason.LENGTH),
        ("c", FinishReason.LENGTH),
    ]
    assert not engine.has_work and engine.num_steps == 3


def test_its_tokens_are_the_fake_models_and_never_eos(model_dir: Path) -> None:
    """The same walk as an engine over the fake backend: the text a client gets is the same."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    fixed = new_engine(model_dir)
    fixed.add(ours := Sequence("r", [TINY_EOS - 1], params))
    while fixed.has_work:
        fixed.step()
    engine = Engine.build(
        model_dir, EngineConfig(block_size=16, cache_max_entry_count=8), backend="fake"
    )
    engine.add(theirs := Sequence("r", [TINY_EOS - 1], params))
    while engine.has_work:
        engine.step()
    assert ours.output_token_ids == theirs.output_token_ids
    assert TINY_EOS not in ours.output_token_ids and len(ours.output_token_ids) == 40
    backend = fixed.backend
    for t in range(backend.vocab_size):  # the int walk is the tensor walk
        assert backend.next_token_id(t) == int(backend.next_token(torch.tensor(t)))


def test_stop_token_ids_and_min_tokens_follow_the_real_rules(model_dir: Path) -> None:
    engine = new_engine(model_dir)
    walk = [3]
    for _ in range(4):
        walk.append(engine.backend.next_token_id(walk[-1]))
    stop = walk[2]  # the second output token
    engine.add(Sequence("early", [3], SamplingParams(max_tokens=10, stop_token_ids=(stop,))))
    params = SamplingParams(max_tokens=10, stop_token_ids=(stop,), min_new_tokens=3)
    engine.add(Sequence("held", [3], params))
    events = [e for _ in range(3) for e in engine.step()]
    ends = {e.request_id: (e.position, e.finish_reason) for e in events if e.finish_reason}
    assert ends == {"early": (1, FinishReason.STOP)}  # held: the stop came before min_tokens
    assert engine.has_work


def test_abort_forgets_the_request_and_bad_requests_say_why(model_dir: Path) -> None:
    engine = new_engine(model_dir, session_len=16)
    engine.add(Sequence("a", [1, 2], SamplingParams(max_tokens=100)))
    engine.step()
    aborted = engine.abort("a")
    assert aborted is not None and aborted.finish_reason == FinishReason.ABORT
    assert engine.abort("a") is None and not engine.has_work and engine.step() == []
    with pytest.raises(ValueError, match="the limit is 15"):
        engine.add(Sequence("long", list(range(16))))
    with pytest.raises(ValueError, match="no logprobs"):
        engine.add(Sequence("lp", [1], SamplingParams(logprobs=2)))
    assert engine.stats() == {"running": 0, "waiting": 0, "queued_tokens": 0}


def test_it_runs_only_in_hybrid_mode(tmp_path: Path) -> None:
    config = ServeConfig(tmp_path, mode="hybrid", decode_backend="fixed")
    assert config.decode_backend == "fixed"
    with pytest.raises(ConfigError, match="only as --mode hybrid --decode-backend fixed"):
        ServeConfig(tmp_path, decode_backend="fixed")
    with pytest.raises(ConfigError, match="only as --mode hybrid --decode-backend fixed"):
        ServeConfig(tmp_path, mode="hybrid", prefill_backend="fixed")
