"""OpenAI's presence/frequency penalties and logit_bias, and bad words, in the sampler
(engine/penalties.py), against the formulas written out; and with overlapped steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.penalties import bad_word_bans, penalize
from lmd.engine.sampler import Sampler
from lmd.engine.sequence import SamplingParams, Sequence, check_token_ids
from lmd.engine.workspace import Workspace
from tests.models import save_tiny_llama

V = 16


def seq(output: list[int], prompt: list[int] | None = None, **sampling: Any) -> Sequence:
    s = Sequence("r", prompt or [1, 2], SamplingParams(temperature=0.0, **sampling))
    s.output_token_ids = list(output)
    return s


def test_presence_and_frequency_penalties_follow_openais_formula() -> None:
    logits = torch.arange(V, dtype=torch.float32).repeat(2, 1)  # [2, V]
    a = seq([15, 15, 3], presence_penalty=0.5, frequency_penalty=1.0)
    b = seq([15])  # asks for nothing: its row is untouched
    out = penalize(logits, [a, b], (), Workspace())
    expected = logits[0].clone()
    expected[15] -= 2 * 1.0 + 0.5  # counted twice, present once
    expected[3] -= 1 * 1.0 + 0.5
    assert torch.equal(out[0], expected)
    assert torch.equal(out[1], logits[1])
    # the prompt's tokens do not count (unlike repetition_penalty)
    prompt_only = seq([], prompt=[15, 15], presence_penalty=2.0, frequency_penalty=2.0)
    assert torch.equal(penalize(logits[:1], [prompt_only], (), Workspace()), logits[:1])


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = torch.zeros(2, V)
    logits[:, 7] = 5.0  # the argmax
    forced = seq([], logit_bias=((2, 100.0),))
    banned = seq([], logit_bias=((7, -100.0), (9, 1.5)))
    tokens, _ = Sampler().sample(logits, [forced, banned]).tolist()
    assert tokens == [2, 9]


def test_a_bad_word_is_never_completed() -> None:
    words = ((7,), (4, 5, 6))
    assert bad_word_bans(seq([1, 4], bad_words=words)) == [7]  # (4, 5, 6) not begun yet
    assert bad_word_bans(seq([4, 5], bad_words=words)) == [7, 6]
    assert bad_word_bans(seq([], prompt=[4, 5], bad_words=words)) == [7, 6]  # prompt too
    logits = torch.zeros(1, V)
    logits[0, 6], logits[0, 7], logits[0, 3] = 9.0, 8.0, 1.0
    tokens, _ = Sampler().sample(logits, [seq([4, 5], bad_words=words)]).tolist()
    assert tokens == [3]


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite number"),
        ({"logit_bias": ((3, 101.0),)}, r"logit_bias values must be in \[-100, 100\]"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias token id must be >= 0"),
        ({"logit_bias": ((3,),)}, r"logit_bias entries must be \(token id, bias\)"),
        ({"logit_bias": tuple((i, 1.0) for i in range(1025))}, "at most 1024 tokens"),
        ({"bad_words": ((),)}, "bad_words takes at most 256 words of 1-32 tokens"),
        ({"bad_words": (("a",),)}, "bad_words token id must be an integer"),
    ],
)
def test_bad_settings_say_what_is_wrong(sampling: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**sampling)


def test_token_ids_outside_the_vocabulary_are_refused_before_a_step() -> None:
    for sampling in ({"logit_bias": [[600, 1.0]]}, {"bad_words": [[3, 600]]}):
        with pytest.raises(ValueError, match="600 is outside this model's vocabulary"):
            check_token_ids(Sequence("r", [1], SamplingParams(**sampling)), 512)


def test_a_list_of_pairs_from_the_wire_is_taken() -> None:
    params = SamplingParams(logit_bias=[[3, 2]], bad_words=[[4, 5]])  # type: ignore[arg-type]
    assert params.logit_bias == ((3, 2.0),) and params.bad_words == ((4, 5),)
    assert params.needs_history and not SamplingParams(logit_bias=((3, 1.0),)).needs_history


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_overlapped_steps_give_the_same_tokens_with_every_setting(model_dir: Path) -> None:
    """A batch with a row that needs its history does not run ahead; one with only
    logit_bias or one-token bad words does, and both give what serial steps give."""
    requests = {
        "presence": SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=1.5),
        "frequency": SamplingParams(temperature=0.0, max_tokens=16, frequency_penalty=2.0),
        "bias": SamplingParams(temperature=0.0, max_tokens=16, logit_bias=((9, 3.0),)),
        "words": SamplingParams(temperature=0.0, max_tokens=16, bad_words=((9,), (30, 31))),
    }
    outputs = []
    for overlap in (False, True):
        config = EngineConfig(block_size=16, cache_max_entry_count=64, overlap_steps=overlap)
        engine = Engine.build(model_dir, config)
        tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        for rid, params in requests.items():
            engine.add(Sequence(rid, [5, 6, 7, 8], params))
        while engine.has_work:
            for event in engine.step():
                tokens[event.request_id].append(event.token_id)
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    assert 9 not in outputs[0]["words"]
    assert all(len(t) == 16 for t in outputs[0].values())
