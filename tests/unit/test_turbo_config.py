"""What the turbo backend accepts from config.json, and how `select_backend` chooses.

Pure CPU, no triton: these run in CI.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from lmd.engine.backend import BackendError
from lmd.engine.backends import select_backend
from lmd.engine.torch_backend import TorchBackend
from lmd.engine.turbo import TurboConfig, UnsupportedModel, unsupported_reason


def llama(**overrides: Any) -> dict[str, Any]:
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        **overrides,
    ).to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    return config


def test_llama_fields() -> None:
    c = TurboConfig.from_dict(llama(tie_word_embeddings=True))
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_queries_per_kv) == (8, 2, 32, 4)
    assert c.qkv_size == (8 + 2 * 2) * 32
    assert c.tie_word_embeddings and not (c.qkv_bias or c.o_bias or c.mlp_bias)
    assert c.windows == (0, 0, 0)


def test_llama_attention_bias_covers_all_four_projections() -> None:
    c = TurboConfig.from_dict(llama(attention_bias=True, mlp_bias=True))
    assert c.qkv_bias and c.o_bias and c.mlp_bias


def test_explicit_head_dim_wins() -> None:
    assert TurboConfig.from_dict(llama(head_dim=64)).head_dim == 64


def test_qwen2_has_qkv_bias_and_windows_only_when_enabled() -> None:
    fields: dict[str, Any] = dict(num_hidden_layers=4, max_window_layers=2, sliding_window=128)
    plain = Qwen2Config(**fields).to_dict() | {"architectures": ["Qwen2ForCausalLM"]}
    c = TurboConfig.from_dict(plain)
    assert c.qkv_bias and not c.o_bias
    assert c.windows == (0, 0, 0, 0)  # use_sliding_window is false by default
    windowed = Qwen2Config(use_sliding_window=True, **fields).to_dict()
    windowed["architectures"] = ["Qwen2ForCausalLM"]
    # transformers applies the window from layer max_window_layers on.
    assert TurboConfig.from_dict(windowed).windows == (0, 0, 128, 128)
    # An original Qwen2.5 config.json has no layer_types.
    del windowed["layer_types"]
    assert TurboConfig.from_dict(windowed).windows == (0, 0, 128, 128)


def test_mistral_window_applies_to_every_layer() -> None:
    raw = MistralConfig(num_hidden_layers=2, sliding_window=4096).to_dict()
    raw["architectures"] = ["MistralForCausalLM"]
    assert TurboConfig.from_dict(raw).windows == (4096, 4096)
    raw["sliding_window"] = None
    assert TurboConfig.from_dict(raw).windows == (0, 0)


def test_qwen3_norms_its_heads_and_windows_as_qwen2() -> None:
    fields: dict[str, Any] = dict(num_hidden_layers=4, max_window_layers=2, sliding_window=64)
    raw = Qwen3Config(use_sliding_window=True, attention_bias=True, **fields).to_dict()
    c = TurboConfig.from_dict(raw | {"architectures": ["Qwen3ForCausalLM"]})
    assert c.qk_norm and c.moe is None
    assert c.qkv_bias and c.o_bias  # Qwen3's attention_bias covers o_proj too, unlike Qwen2
    assert c.windows == (0, 0, 64, 64)
    assert c.head_dim == 128  # Qwen3 names its head_dim; hidden / heads would be 128 too


def test_qwen3_moe_sparse_layers_follow_transformers() -> None:
    raw = Qwen3MoeConfig(
        num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True
    ).to_dict()
    c = TurboConfig.from_dict(raw | {"architectures": ["Qwen3MoeForCausalLM"]})
    assert c.qk_norm and c.moe is not None
    assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size) == (128, 8, 768)
    assert c.moe.normalize_top_k
    # Layer i has experts when (i + 1) % 2 == 0 and i is not in mlp_only_layers.
    assert c.moe.sparse_layers == (False, True, False, False, False, True)
    # A published Qwen3-30B-A3B config.json spells the count num_experts.
    published = {k: v for k, v in raw.items() if k != "num_local_experts"} | {"num_experts": 64}
    published["architectures"] = ["Qwen3MoeForCausalLM"]
    assert TurboConfig.from_dict(published).moe.num_experts == 64  # type: ignore[union-attr]


def test_mixtral_has_experts_everywhere_normalized_and_windowed() -> None:
    raw = MixtralConfig(num_hidden_layers=2, sliding_window=32, num_local_experts=8).to_dict()
    c = TurboConfig.from_dict(raw | {"architectures": ["MixtralForCausalLM"]})
    assert c.moe is not None and not c.qk_norm
    assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size) == (8, 2, 14336)
    assert c.moe.normalize_top_k and c.moe.sparse_layers == (True, True)
    assert c.windows == (32, 32)


def test_gemma3_local_and_global_layers() -> None:
    raw = Gemma3TextConfig(num_hidden_layers=7, sliding_window=512).to_dict()
    c = TurboConfig.from_dict(raw | {"architectures": ["Gemma3ForCausalLM"]})
    assert c.windows == (512,) * 5 + (0, 512)  # every sixth layer global
    assert c.activation == "gelu_tanh" and c.qk_norm and c.norm_plus_one and c.sandwich_norms
    assert c.attn_scale == 256**-0.5 and c.embed_scale == 2304**0.5
    # A config.json without layer_types (as first published): the same pattern.
    del raw["layer_types"]
    c = TurboConfig.from_dict(raw | {"architectures": ["Gemma3ForCausalLM"]})
    assert c.windows == (512,) * 5 + (0, 512)


def test_softcapping_is_refused_by_name() -> None:
    raw = Gemma2Config(num_hidden_layers=2).to_dict() | {"architectures": ["Gemma3ForCausalLM"]}
    with pytest.raises(UnsupportedModel, match=r"attn_logit_softcapping 50\.0 is not implemented"):
        TurboConfig.from_dict(raw)


def test_more_experts_per_token_than_experts_is_refused() -> None:
    raw = MixtralConfig(num_hidden_layers=1, num_local_experts=2, num_experts_per_tok=3)
    with pytest.raises(UnsupportedModel, match="3 experts per token of 2 experts"):
        TurboConfig.from_dict(raw.to_dict() | {"architectures": ["MixtralForCausalLM"]})


def test_static_rope_scalings_are_accepted_in_both_spellings() -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0}  # fmt: skip
    TurboConfig.from_dict(llama() | {"rope_parameters": rope})
    legacy = llama()
    del legacy["rope_parameters"]
    TurboConfig.from_dict(legacy | {"rope_scaling": {"type": "linear", "factor": 2.0}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture GPT2LMHeadModel is not one of"),
        ({"hidden_act": "gelu"}, "activation 'gelu' is not one of silu, gelu_pytorch_tanh"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial"),
        ({"num_key_value_heads": 3}, "do not split evenly over 3 KV heads"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
    ],
)
def test_unsupported_configs_say_why(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModel, match=message) as info:
        TurboConfig.from_dict(llama() | change)
    assert "\n" not in str(info.value)


def test_missing_field_is_named(tmp_path: Any) -> None:
    raw = llama()
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(__import__("json").dumps(raw))
    with pytest.raises(UnsupportedModel, match="has no 'hidden_size'"):
        TurboConfig.load(tmp_path)


# Selection (docs/architecture.md §5) -----------------------------------------------------------


def test_auto_on_cpu_takes_torch_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert select_backend("auto", "LlamaForCausalLM", "cpu") is TorchBackend
    assert "using torch for LlamaForCausalLM because turbo needs CUDA and the device is cpu" in (
        caplog.text
    )


def test_explicit_turbo_that_cannot_run_is_a_one_line_error() -> None:
    with pytest.raises(BackendError, match="backend turbo cannot run here: turbo needs CUDA") as e:
        select_backend("turbo", "LlamaForCausalLM", "cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(BackendError, match="turbo does not implement Gemma2ForCausalLM"):
        select_backend("turbo", "Gemma2ForCausalLM", "cuda")


def test_auto_takes_torch_for_architectures_turbo_lacks(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert select_backend("auto", "Gemma2ForCausalLM", "cuda") is TorchBackend
    assert "turbo does not implement Gemma2ForCausalLM" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_turbo_on_cuda_without_a_gpu_says_so() -> None:
    assert unsupported_reason("LlamaForCausalLM", "cuda") == (
        "turbo needs CUDA and torch sees no CUDA device"
    )
