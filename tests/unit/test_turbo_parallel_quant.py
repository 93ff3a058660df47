"""A quantized checkpoint split over a tensor-parallel group (turbo/checkpoint.py's
`_packed_split`): each rank reads its part of AWQ's and GPTQ's packed words, groups and
zero points and of FP8's scale blocks, and holds what the whole model's fused linears
hold for its heads and its part of the width (an MoE's experts too: 4-bit from AWQ, FP8
from FP8), bit for bit. An act-order checkpoint, and
a part that does not fall on its tensor's units, are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

pytest.importorskip("triton")
from tests.unit.test_turbo_kernels import ON_CUDA  # noqa: F401, I001  (first: the interpreter)

from lmd.engine.parallel import SINGLE, TensorParallel
from lmd.engine.turbo.config import TurboConfig, UnsupportedModel
from lmd.engine.turbo.quant.scheme import read_scheme
from lmd.engine.turbo.weights import ModelWeights, load_weights
from tests.models import TINY_SHAPE, save_tiny_llama
from tests.unit.test_turbo_quant import experts_dense
from tests.unit.test_turbo_quant_checkpoints import FORMATS, write_checkpoint

CPU = torch.device("cpu")
# Every rank's part a multiple of 128 rows or columns: 4 heads and 4 KV heads of 64.
SPLITS = {"hidden_size": 256, "intermediate_size": 512, "num_key_value_heads": 4}


def quantized(tmp_path: Path, fmt: str, **shape: int) -> Path:
    base = save_tiny_llama(tmp_path / "base", num_attention_heads=4, **(SPLITS | shape))
    model = tmp_path / fmt
    write_checkpoint(base, model, FORMATS[fmt], fmt)
    return model


def load(model: Path, tp: TensorParallel) -> ModelWeights:
    scheme = read_scheme(json.loads((model / "config.json").read_text()), None)
    return load_weights(model, TurboConfig.load(model), CPU, torch.bfloat16, scheme, tp=tp)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "fp8"])
def test_each_rank_holds_its_part_of_the_dequantized_linears(tmp_path: Path, fmt: str) -> None:
    model = quantized(tmp_path, fmt)
    whole = load(model, SINGLE)
    heads, width = 128, 256  # a rank's rows of q, k or v; its part of the width
    for rank in range(2):
        mine = load(model, TensorParallel(rank, 2))
        part = slice(rank * heads, (rank + 1) * heads)
        cols = slice(rank * width, (rank + 1) * width)
        for got, layer in zip(mine.layers, whole.layers, strict=True):
            qkv = layer.qkv.dequantize()
            expected = torch.cat([qkv[part], qkv[256:][part], qkv[512:][part]])
            assert torch.equal(got.qkv.dequantize(), expected)
            assert torch.equal(got.o.dequantize(), layer.o.dequantize()[:, part])
            gate_up = layer.gate_up.dequantize()  # type: ignore[union-attr]
            expected = torch.cat([gate_up[cols], gate_up[512:][cols]])
            assert torch.equal(got.gate_up.dequantize(), expected)  # type: ignore[union-attr]
            down = layer.down.dequantize()  # type: ignore[union-attr]
            assert torch.equal(got.down.dequantize(), down[:, cols])  # type: ignore[union-attr]


def test_an_act_order_checkpoint_is_refused(tmp_path: Path) -> None:
    model = quantized(tmp_path, "gptq_act")
    with pytest.raises(UnsupportedModel, match="does not split act-order"):
        load(model, TensorParallel(0, 2))


def test_a_part_off_the_scale_blocks_is_refused(tmp_path: Path) -> None:
    """Two KV heads of 64: a rank's k rows are 64, half an FP8 scale block."""
    model = quantized(tmp_path, "fp8", num_key_value_heads=2)
    with pytest.raises(UnsupportedModel, match=r"k_proj.weight_scale_inv: rank 1's part 64:128"):
        load(model, TensorParallel(1, 2))


@pytest.mark.parametrize("fmt", ["awq", "fp8"])
def test_each_rank_holds_its_part_of_the_dequantized_experts(tmp_path: Path, fmt: str) -> None:
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256}
    config = Qwen3MoeConfig(**(TINY_SHAPE | SPLITS | experts | {"head_dim": 64}))
    torch.manual_seed(5)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "base")
    model = tmp_path / fmt
    write_checkpoint(tmp_path / "base", model, FORMATS[fmt], fmt)
    whole = load(model, SINGLE).layers[0].experts
    assert whole is not None
    for rank in range(2):
        mine = load(model, TensorParallel(rank, 2)).layers[0].experts
        assert mine is not None
        part = slice(rank * 128, (rank + 1) * 128)
        whole_gate_up, whole_down = experts_dense(whole.gate_up), experts_dense(whole.down)
        gate_up = torch.cat([whole_gate_up[:, part], whole_gate_up[:, 256:][:, part]], dim=1)
        assert torch.equal(experts_dense(mine.gate_up), gate_up)
        assert torch.equal(experts_dense(mine.down), whole_down[:, :, part])
