"""lmd.pipeline's get_ppl, output_logits and output_last_hidden_state against transformers
on a tiny random Llama in float32 (no tokenizer: token-id prompts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from lmd.engine.backend import Backend
from lmd.pipeline import GenerationConfig, Pipeline, PytorchEngineConfig, pipeline, scoring
from tests.models import TINY_VOCAB, load_reference, random_prompts, save_tiny_llama

# Small blocks and prefill steps: sequences span blocks, long ones are scored in chunks,
# short ones packed together.
SETTINGS = PytorchEngineConfig(
    device_type="cpu", block_size=4, max_prefill_token_num=16, cache_max_entry_count=256
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("pipeline-llama"), initializer_range=0.05)


@pytest.fixture(scope="module")
def pipe(model_dir: Path) -> Iterator[Pipeline]:
    with pipeline(model_dir, backend_config=SETTINGS) as p:
        yield p


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> PreTrainedModel:
    return load_reference(model_dir)


def hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = model(torch.tensor([ids])).logits[0]  # [T, V]
    return out


def hf_hidden(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """The last decoder layer's output after the final norm: lm_head's input."""
    with torch.inference_mode():
        out: torch.Tensor = model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, H]
    return out


def test_get_ppl_equals_the_loss_transformers_computes(
    pipe: Pipeline, reference: PreTrainedModel
) -> None:
    # 2 tokens, packed short ones, one over the 16-token step (chunked), one far over it.
    seqs = random_prompts([2, 7, 5, 40, 100, 9])
    ppl = pipe.get_ppl(seqs)
    with torch.inference_mode():
        expected = [
            float(reference(torch.tensor([s]), labels=torch.tensor([s])).loss) for s in seqs
        ]
    assert ppl == pytest.approx(expected, abs=1e-4)
    assert pipe.get_ppl(seqs[3]) == pytest.approx(expected[3:4], abs=1e-4)  # one list of ids
    assert pipe.stats()["kv"]["free_blocks"] == pipe.stats()["kv"]["total_blocks"]


@pytest.mark.parametrize("mode", ["generation", "all"])
def test_logits_equal_transformers(pipe: Pipeline, reference: PreTrainedModel, mode: str) -> None:
    prompts = random_prompts([5, 23], seed=3)
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True, output_logits=mode)
    responses = pipe(prompts, gen_config=gen)
    assert isinstance(responses, list)
    for prompt, r in zip(prompts, responses, strict=True):
        assert r.logits is not None and r.last_hidden_state is None
        expected = hf_logits(reference, prompt + r.token_ids[:-1])
        if mode == "generation":
            expected = expected[len(prompt) - 1 :]
        assert r.logits.shape == (len(expected), TINY_VOCAB) == expected.shape
        assert r.logits.dtype == torch.float32 and r.logits.device.type == "cpu"
        torch.testing.assert_close(r.logits, expected, atol=1e-4, rtol=1e-4)
        # Greedy: each generated token is the argmax of the row it was sampled from.
        assert r.logits[-len(r.token_ids) :].argmax(-1).tolist() == r.token_ids


@pytest.mark.parametrize("mode", ["generation", "all"])
def test_last_hidden_states_equal_transformers(
    pipe: Pipeline, reference: PreTrainedModel, mode: str
) -> None:
    prompt = random_prompts([30], seed=4)[0]  # scored in two chunks
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True, output_last_hidden_state=mode)
    r = pipe(prompt, gen_config=gen)
    assert not isinstance(r, list) and r.last_hidden_state is not None and r.logits is None
    expected = hf_hidden(reference, prompt + r.token_ids[:-1])
    if mode == "generation":
        expected = expected[len(prompt) - 1 :]
    assert r.last_hidden_state.shape == expected.shape == (len(expected), 64)
    torch.testing.assert_close(r.last_hidden_state, expected, atol=1e-4, rtol=1e-4)


def test_streams_carry_the_tensors_on_their_last_response(pipe: Pipeline) -> None:
    prompt = random_prompts([6], seed=5)[0]
    gen = GenerationConfig(
        max_new_tokens=5,
        ignore_eos=True,
        output_logits="generation",
        output_last_hidden_state="all",
    )
    deltas = list(pipe.stream_infer(prompt, gen_config=gen))
    *early, last = deltas
    assert all(d.logits is None and d.last_hidden_state is None for d in early)
    assert last.finish_reason == "length"
    assert last.logits is not None and last.logits.shape == (5, TINY_VOCAB)
    assert last.last_hidden_state is not None and last.last_hidden_state.shape == (6 + 4, 64)


def test_a_pass_packs_short_sequences_and_chunks_long_ones(pipe: Pipeline) -> None:
    backend: Backend = pipe.backend
    seqs = random_prompts([3, 4, 20, 2], seed=6)
    parts = [
        (p.index, p.start, len(p.logits)) for p in scoring.run(backend, seqs, block_size=4, rows=8)
    ]
    # [3 + 4] fit one forward; 20 goes 8 + 8 + 4 (its own pool); then the 2.
    assert parts == [(0, 0, 3), (1, 0, 4), (2, 0, 8), (2, 8, 8), (2, 16, 4), (3, 0, 2)]
    assert scoring.max_rows(backend, 10**6) * 4 * backend.vocab_size <= scoring.LOGITS_BYTES
