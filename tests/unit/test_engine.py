"""The in-process engine on a tiny random Llama: exact against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.sequence import FinishReason, SamplingParams, Sequence
from tests.models import hf_greedy, load_reference, random_prompts, save_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LENGTHS = [3, 17, 40, 64, 65, 100]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> PreTrainedModel:
    return load_reference(model_dir)


def make_engine(model_dir: Path, **overrides: object) -> Engine:
    settings: dict[str, object] = {"block_size": 16, "cache_max_entry_count": 256}
    settings.update(overrides)
    return Engine.build(model_dir, EngineConfig(**settings))  # type: ignore[arg-type]


def run(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams = GREEDY,
) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add(Sequence(f"r{i}", prompt, params))
        out[f"r{i}"] = []
    while engine.has_work:
        for event in engine.step():
            out[event.request_id].append(event.token_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    return out


def test_concurrent_greedy_equals_transformers(model_dir: Path, reference: PreTrainedModel) -> None:
    prompts = random_prompts(LENGTHS)
    out = run(make_engine(model_dir), prompts)
    for i, prompt in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(reference, prompt, GREEDY.max_tokens)


def test_sixteen_concurrent_equal_sequential(model_dir: Path) -> None:
    prompts = random_prompts([5 + 7 * i for i in range(16)], seed=3)
    together = run(make_engine(model_dir), prompts)
    engine = make_engine(model_dir)
    for i, prompt in enumerate(prompts):
        assert run(engine, [prompt])["r0"] == together[f"r{i}"]


def test_chunked_prefill_equals_unchunked(model_dir: Path) -> None:
    prompts = random_prompts([90, 130], seed=4)
    unchunked = make_engine(model_dir)
    whole = run(unchunked, prompts)
    chunked = make_engine(model_dir, max_prefill_token_num=24)
    assert run(chunked, prompts) == whole
    # 220 prompt tokens in 24-token steps: at least 9 prefill steps instead of 1.
    assert chunked.num_steps >= unchunked.num_steps + 8


def test_prefix_cache_hit_gives_same_tokens_and_computes_less(model_dir: Path) -> None:
    prefix = random_prompts([64], seed=5)[0]
    first, second = [*prefix, 7, 8, 9], [*prefix, 7, 8, 9, 10]
    engine = make_engine(model_dir, enable_prefix_caching=True)
    assert run(engine, [first])["r0"] == run(make_engine(model_dir), [first])["r0"]
    seq = Sequence("again", second, GREEDY)
    engine.add(seq)
    tokens = []
    while engine.has_work:
        tokens += [e.token_id for e in engine.step()]
    assert seq.num_prefix_cached_tokens == 64  # four full blocks reused
    assert tokens == run(make_engine(model_dir), [second])["r0"]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped steps"])
def test_preemption_under_a_small_pool_keeps_tokens_exact(model_dir: Path, overlap: bool) -> None:
    prompts = random_prompts([30, 31, 32, 33], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = run(make_engine(model_dir), prompts, params)
    # 192 tokens for 4 x 72
    tight = make_engine(model_dir, cache_max_entry_count=12, overlap_steps=overlap)
    seqs = [Sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for seq in seqs:
        tight.add(seq)
    while tight.has_work:
        tight.step()
    assert sum(seq.num_preemptions for seq in seqs) > 0
    assert {seq.request_id: seq.output_token_ids for seq in seqs} == roomy
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_total_blocks


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped steps"])
@pytest.mark.parametrize("blocks", [256, 12], ids=["roomy", "preempting"])
def test_mixed_steps_give_the_tokens_of_separate_steps(
    model_dir: Path, blocks: int, overlap: bool
) -> None:
    """Prompts that arrive while others decode run in the decode steps' forwards (chunks
    of what max_prefill_token_num leaves); each request's tokens are unchanged."""
    prompts = random_prompts([40, 70, 9, 100, 33], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = []
    for mixed in (False, True):
        engine = make_engine(
            model_dir,
            mixed_prefill_tokens=16 if mixed else 0,
            max_prefill_token_num=32,
            cache_max_entry_count=blocks,
            overlap_steps=overlap,
        )
        seqs = [Sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
        for seq in seqs:  # one arrives every third step
            engine.add(seq)
            for _ in range(3):
                engine.step()
        while engine.has_work:
            engine.step()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
        assert (engine.num_mixed_steps > 0) == mixed
        if blocks == 12:
            assert sum(seq.num_preemptions for seq in seqs) > 0
        outs.append({seq.request_id: seq.output_token_ids for seq in seqs})
    assert outs[1] == outs[0] == run(make_engine(model_dir), prompts, params)


def test_prompts_get_prefill_steps_when_decode_rows_fill_a_step(model_dir: Path) -> None:
    """With more decoding sequences than max_prefill_token_num rows, a mixed step would have
    no room for prompt tokens: prompts take steps of their own instead of waiting."""
    prompts = random_prompts([3] * 8, seed=9)
    engine = make_engine(model_dir, max_prefill_token_num=4, mixed_prefill_tokens=16)
    seqs = [Sequence(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    prefilled_beside_full_decode = 0
    for seq in seqs:
        engine.add(seq)
    while engine.has_work:
        decoding, queued = engine.decode.num_seqs, engine.prefill.num_queued_tokens
        engine.step()
        if decoding >= 4 and engine.prefill.num_queued_tokens < queued:
            prefilled_beside_full_decode += 1
    assert prefilled_beside_full_decode > 0
    outs = {seq.request_id: seq.output_token_ids for seq in seqs}
    assert outs == run(make_engine(model_dir), prompts)


def test_abort_frees_every_block(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    for i, prompt in enumerate(random_prompts([20, 50, 80], seed=7)):
        engine.add(Sequence(f"r{i}", prompt, GREEDY))
    for _ in range(4):
        engine.step()
    for i in range(3):
        aborted = engine.abort(f"r{i}")
        assert aborted is not None and aborted.finish_reason == FinishReason.ABORT
    assert not engine.has_work
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(model_dir: Path) -> None:
    prompts = random_prompts([12, 25], seed=8)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    a = run(make_engine(model_dir), prompts, seeded)
    b = run(make_engine(model_dir), [prompts[1], prompts[0]], seeded)
    assert a["r0"] == b["r1"] and a["r1"] == b["r0"]
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert run(make_engine(model_dir), prompts, top1) == run(
        make_engine(model_dir), prompts, greedy
    )


def test_max_tokens_and_eos_finish_reasons(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.add(Sequence("n", random_prompts([10])[0], SamplingParams(temperature=0, max_tokens=5)))
    events = []
    while engine.has_work:
        events += engine.step()
    assert len(events) <= 5
    assert events[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert all(e.finish_reason is None for e in events[:-1])


def test_a_prompt_over_the_session_length_is_rejected(model_dir: Path) -> None:
    engine = make_engine(model_dir, session_len=64)
    with pytest.raises(ValueError, match="limit is 63"):
        engine.add(Sequence("long", list(range(2, 70)), GREEDY))


def test_token_ids_outside_the_vocabulary_fail_that_request_alone(model_dir: Path) -> None:
    """An id past the vocabulary would index past the embedding (prompt) or the logits (a
    stop token banned by min_new_tokens) and fail the step of every request with it."""
    engine = make_engine(model_dir)
    vocab = engine.backend.vocab_size
    engine.add(Sequence("good", [5, 6, 7], GREEDY))
    banned_stop = SamplingParams(stop_token_ids=(3, vocab + 7), min_new_tokens=2, max_tokens=4)
    for bad, what in (
        (Sequence("oov", [5, vocab, 6], GREEDY), f"prompt token id {vocab} "),
        (Sequence("stop", [5, 6], banned_stop), f"stop_token_ids entry {vocab + 7} "),
    ):
        with pytest.raises(ValueError, match=f"{what}is outside this model's vocabulary"):
            engine.add(bad)
    tokens = []
    while engine.has_work:
        tokens += [e.token_id for e in engine.step()]
    assert len(tokens) == GREEDY.max_tokens  # the good request, untouched
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_a_sliding_window_model_frees_blocks_behind_it_and_keeps_its_tokens(
    tmp_path: Path,
) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    from tests.models import TINY_SHAPE

    torch.manual_seed(4)
    MistralForCausalLM(MistralConfig(**TINY_SHAPE, sliding_window=12)).save_pretrained(tmp_path)
    engine = make_engine(tmp_path, block_size=4)
    assert engine.block_manager.window == 12
    prompts = random_prompts([5, 30], engine.backend.vocab_size, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add(Sequence(f"r{i}", prompt, params))
    out: dict[str, list[int]] = {"r0": [], "r1": []}
    most_used = 0
    while engine.has_work:
        for event in engine.step():
            out[event.request_id].append(event.token_id)
        most_used = max(most_used, engine.block_manager.num_used_blocks)
    # Each sequence holds its window's blocks plus the one being filled, never its whole
    # context (70 tokens: 18 blocks each).
    assert most_used <= 2 * (12 // 4 + 2)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    for i, prompt in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(ref, prompt, 40)
