"""EngineConfig: LMDeploy defaults, validation messages, session_len resolution."""

from __future__ import annotations

import pytest

from lmd.engine.config import EngineConfig


def test_defaults_match_lmdeploy() -> None:
    config = EngineConfig()
    assert config.block_size == 64
    assert config.max_batch_size == 128
    assert config.max_prefill_token_num == 8192
    assert config.session_len is None
    assert config.cache_max_entry_count == 0.8
    assert not config.cache_is_block_count
    assert config.enable_prefix_caching is False


def test_int_cache_max_entry_count_is_a_block_count() -> None:
    config = EngineConfig(cache_max_entry_count=1000)
    assert config.cache_is_block_count
    assert EngineConfig(cache_max_entry_count=1.0).cache_is_block_count is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        ({"max_batch_size": -3}, "max_batch_size must be an integer >= 1, got -3"),
        ({"max_prefill_token_num": 0}, "max_prefill_token_num must be an integer >= 1"),
        ({"session_len": 1}, "session_len must be an integer >= 2, got 1"),
        ({"block_size": 16.0}, "block_size must be an integer >= 1, got 16.0"),
        ({"cache_max_entry_count": 0.0}, r"as a fraction must be in \(0, 1\], got 0.0"),
        ({"cache_max_entry_count": 1.5}, r"as a fraction must be in \(0, 1\], got 1.5"),
        ({"cache_max_entry_count": 0}, "as a block count must be > 0, got 0"),
        ({"cache_max_entry_count": True}, "must be a fraction in"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be true or false"),
        ({"cpu_matmul_dtype": "bf16"}, "cpu_matmul_dtype must be one of auto, float32, bfloat16"),
    ],
)
def test_out_of_range_values_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_session_len_resolves_to_the_model_maximum() -> None:
    assert EngineConfig().with_session_len(8192).session_len == 8192
    assert EngineConfig(session_len=2048).with_session_len(8192).session_len == 2048


def test_session_len_beyond_the_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="session_len=9000 exceeds the model's context length"):
        EngineConfig(session_len=9000).with_session_len(8192)


def test_config_has_no_instance_dict() -> None:
    config = EngineConfig()
    with pytest.raises(AttributeError):
        config.blocksize = 32  # type: ignore[attr-defined]
