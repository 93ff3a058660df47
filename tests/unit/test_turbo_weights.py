"""Checkpoint -> the turbo decoder's fused tensors, and the rotary table.

Pure CPU, no triton: these run in CI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from lmd.engine.turbo import TurboConfig, UnsupportedModel
from lmd.engine.turbo.quant.load import Experts
from lmd.engine.turbo.rope import rope_table
from lmd.engine.turbo.weights import eos_token_ids, load_weights
from tests.models import TINY_EOS, TINY_SHAPE, save_tiny_llama

CPU = torch.device("cpu")


def sixteen(stack: Experts) -> Tensor:
    """A layer of experts' 16-bit (or float32) weights of one projection."""
    assert isinstance(stack, Tensor)
    return stack


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("weights-llama"))


def test_fused_tensors_are_the_checkpoint_in_order(llama_dir: Path) -> None:
    config = TurboConfig.load(llama_dir)
    weights = load_weights(llama_dir, config, CPU, torch.bfloat16)
    ref = LlamaForCausalLM.from_pretrained(llama_dir, local_files_only=True, dtype=torch.bfloat16)
    for i, layer in enumerate(weights.layers):
        hf = ref.model.layers[i]
        attn, mlp = hf.self_attn, hf.mlp
        assert isinstance(layer.qkv, Tensor) and isinstance(layer.o, Tensor)
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        assert torch.equal(layer.qkv, qkv)
        assert isinstance(layer.gate_up, Tensor) and isinstance(layer.down, Tensor)
        assert layer.experts is None
        assert torch.equal(layer.gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        assert torch.equal(layer.o, attn.o_proj.weight)
        assert torch.equal(layer.down, mlp.down_proj.weight)
        assert torch.equal(layer.input_norm, hf.input_layernorm.weight)
        assert torch.equal(layer.post_norm, hf.post_attention_layernorm.weight)
        assert layer.qkv_bias is None and layer.o_bias is None
    assert torch.equal(weights.lm_head, ref.lm_head.weight)
    assert weights.lm_head is not weights.embed  # the tiny Llama is untied
    assert weights.embed.dtype == torch.bfloat16
    expected = sum(p.numel() for p in ref.parameters()) * 2
    assert weights.nbytes == expected


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("weights-moe")
    fields: dict[str, Any] = {
        **TINY_SHAPE,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "mlp_only_layers": [1],
    }
    config = Qwen3MoeConfig(**fields)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def test_experts_are_stacked_in_expert_order(moe_dir: Path) -> None:
    config = TurboConfig.load(moe_dir)
    weights = load_weights(moe_dir, config, CPU, torch.float32)
    tensors = load_file(moe_dir / "model.safetensors")
    sparse, dense = weights.layers
    assert sparse.experts is not None and sparse.gate_up is None and sparse.down is None
    assert dense.experts is None and dense.gate_up is not None
    for j in range(4):
        expert = f"model.layers.0.mlp.experts.{j}"
        gate_up = torch.cat(
            [tensors[f"{expert}.gate_proj.weight"], tensors[f"{expert}.up_proj.weight"]]
        )
        assert torch.equal(sixteen(sparse.experts.gate_up)[j], gate_up)
        assert torch.equal(sixteen(sparse.experts.down)[j], tensors[f"{expert}.down_proj.weight"])
    assert torch.equal(sparse.experts.router, tensors["model.layers.0.mlp.gate.weight"])
    assert sparse.q_norm is not None and torch.equal(
        sparse.q_norm, tensors["model.layers.0.self_attn.q_norm.weight"]
    )
    assert weights.nbytes == sum(t.numel() * 4 for t in tensors.values())


def test_experts_already_stacked_load_as_they_are(moe_dir: Path, tmp_path: Path) -> None:
    """The stacked form transformers 5 holds in memory, if a checkpoint carries it."""
    tensors = load_file(moe_dir / "model.safetensors")
    prefix = "model.layers.0.mlp.experts"
    parts = [
        tensors.pop(f"{prefix}.{j}.{n}_proj.weight")
        for j in range(4)
        for n in ("gate", "up", "down")
    ]
    tensors[f"{prefix}.gate_up_proj"] = torch.stack(
        [torch.cat(parts[3 * j : 3 * j + 2]) for j in range(4)]
    )
    tensors[f"{prefix}.down_proj"] = torch.stack(parts[2::3])
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((moe_dir / "config.json").read_text())
    stacked = load_weights(tmp_path, TurboConfig.load(tmp_path), CPU, torch.float32)
    per_expert = load_weights(moe_dir, TurboConfig.load(moe_dir), CPU, torch.float32)
    assert stacked.layers[0].experts is not None and per_expert.layers[0].experts is not None
    ours, theirs = stacked.layers[0].experts, per_expert.layers[0].experts
    assert torch.equal(sixteen(ours.gate_up), sixteen(theirs.gate_up))
    assert torch.equal(sixteen(ours.down), sixteen(theirs.down))


def test_missing_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(llama_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match=r"no tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(tmp_path, TurboConfig.load(tmp_path), CPU, torch.float32)


def test_shapes_that_contradict_the_config_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(llama_dir / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match=r"layer 0 down is \(64, 100\)"):
        load_weights(tmp_path, TurboConfig.load(tmp_path), CPU, torch.float32)


def test_eos_comes_from_the_generation_config(llama_dir: Path) -> None:
    assert eos_token_ids(llama_dir) == (TINY_EOS,)


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
         "rope_theta": 10000.0},
    ],
)  # fmt: skip
def test_rope_table_is_transformers_cos_and_sin(
    tmp_path: Path, rope: dict[str, Any] | None
) -> None:
    overrides: dict[str, Any] = {} if rope is None else {"rope_parameters": rope}
    save_tiny_llama(tmp_path, **overrides)
    table = rope_table(tmp_path, 300, CPU)  # [P, D]
    config = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    rotary = LlamaRotaryEmbedding(config=config)
    positions = torch.arange(300)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, D]
    half = table.shape[1] // 2
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], rtol=0, atol=1e-6)
    assert torch.equal(cos[0, :, :half], cos[0, :, half:])  # rotate-half duplicates angles
