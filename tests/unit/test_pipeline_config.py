"""lmd.pipeline's configs: LMDeploy's names mapped onto the engine's, and one clear
ValueError for each bad value (no model needed)."""

from __future__ import annotations

from typing import Any

import pytest

from lmd.engine.config import EngineConfig
from lmd.pipeline import GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig


def test_greedy_unless_do_sample() -> None:
    greedy = GenerationConfig(temperature=0.7, top_k=5).sampling_params(max_tokens=9)
    assert greedy.is_greedy and greedy.max_tokens == 9
    sampled = GenerationConfig(
        do_sample=True,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.1,
        random_seed=3,
        stop_token_ids=[7],
        min_new_tokens=2,
        logprobs=4,
        ignore_eos=True,
    ).sampling_params(max_tokens=9)
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.min_p) == (0.7, 5, 0.9, 0.1)
    assert (sampled.seed, sampled.stop_token_ids, sampled.min_new_tokens) == (3, (7,), 2)
    assert sampled.logprobs == 4 and sampled.ignore_eos


def test_engine_configs_map_onto_the_engine() -> None:
    torch_config = PytorchEngineConfig(
        session_len=512,
        max_batch_size=8,
        block_size=16,
        cache_max_entry_count=0.5,
        cpu_matmul_dtype="float32",
    )
    assert torch_config.backend == "torch"
    assert torch_config.engine_config() == EngineConfig(
        block_size=16,
        max_batch_size=8,
        max_prefill_token_num=4096,
        session_len=512,
        cache_max_entry_count=0.5,
        cpu_matmul_dtype="float32",
    )
    turbo = TurbomindEngineConfig(cache_block_seq_len=32, enable_prefix_caching=True)
    assert turbo.backend == "auto"
    assert turbo.engine_config() == EngineConfig(
        block_size=32, max_batch_size=128, max_prefill_token_num=8192, enable_prefix_caching=True
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 2}, "n must be 1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ({"random_seed": "7"}, "random_seed must be an integer"),
        ({"do_sample": 1}, "do_sample must be True or False"),
        ({"stop_words": "###"}, "stop_words must be a list of strings"),
        ({"output_logits": "prompt"}, "output_logits must be None, 'generation' or 'all'"),
        ({"output_last_hidden_state": True}, "output_last_hidden_state must be None"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"logprobs": 21}, "logprobs must be in 0..20"),
        ({"stop_token_ids": [-1]}, "stop_token_ids entry must be >= 0"),
    ],
)
def test_bad_generation_config_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "tp must be an integer from 1 to 8"),
        ({"tp": 2.0}, "tp must be an integer from 1 to 8"),
        ({"device_type": "tpu"}, "device_type must be 'cuda', 'cuda:N', 'cpu' or None"),
        ({"block_size": 0}, "block_size must be an integer >= 1"),
        ({"cache_max_entry_count": 1.5}, "cache_max_entry_count as a fraction"),
        ({"session_len": 1}, "session_len must be an integer >= 2"),
        ({"max_batch_size": -4}, "max_batch_size must be an integer >= 1"),
        ({"cpu_matmul_dtype": "half"}, "cpu_matmul_dtype must be one of"),
    ],
)
def test_bad_engine_config_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PytorchEngineConfig(**kwargs)


def test_engine_configs_take_keywords_only() -> None:
    with pytest.raises(TypeError):
        PytorchEngineConfig("bfloat16")  # type: ignore[call-arg]  # LMDeploy's order differs
