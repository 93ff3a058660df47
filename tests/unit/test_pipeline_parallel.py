"""A pipeline whose engine spans a tensor-parallel group of two gloo processes (tp=2 on
the CPU): the same greedy tokens as one process and as transformers; closing it stops
the other rank; a size that does not split the model's heads is a ValueError."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lmd import GenerationConfig, PytorchEngineConfig, Response, pipeline
from tests.integration.daemon import alive, wait_until
from tests.models import hf_greedy, load_reference, random_prompts, save_tiny_llama

PROMPTS = random_prompts([5, 40, 77], seed=23)
GREEDY = GenerationConfig(max_new_tokens=12, ignore_eos=True)


def settings(tp: int) -> PytorchEngineConfig:
    return PytorchEngineConfig(
        tp=tp,
        device_type="cpu",
        block_size=16,
        cache_max_entry_count=64,
        cpu_matmul_dtype="float32",  # two ranks against one, token for token
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny Llama (4 heads over 2 KV heads) with SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return save_tiny_llama(path)


def test_two_ranks_give_one_process_tokens_and_close_their_ranks(model_dir: Path) -> None:
    model = load_reference(model_dir)
    reference = [hf_greedy(model, prompt, GREEDY.max_new_tokens or 0) for prompt in PROMPTS]
    with pipeline(model_dir, settings(2)) as pipe:
        ranks = pipe.stats()["ranks"]
        assert [r["rank"] for r in ranks] == [1] and alive(ranks[0]["pid"])
        got = pipe(PROMPTS, gen_config=GREEDY)
        assert isinstance(got, list) and [r.token_ids for r in got] == reference
        one = pipe(PROMPTS[2], gen_config=GREEDY)  # alone: the same tokens
        assert isinstance(one, Response) and one.token_ids == reference[2]
        kv = pipe.stats()["kv"]  # every block back (the ranks use these block ids)
        assert kv["free_blocks"] == kv["total_blocks"]
    wait_until(lambda: not alive(ranks[0]["pid"]), 10, "rank 1 gone with close()")
    with pytest.raises(RuntimeError, match="closed"):
        pipe(PROMPTS[0], gen_config=GREEDY)


def test_a_size_that_does_not_split_the_heads_is_a_value_error(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="3 ranks cannot split the model's 4 attention heads"):
        pipeline(model_dir, settings(3))
