"""Llama-style RMSNorm as one torch.rms_norm kernel (engine/torch_backend/norm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from lmd.engine.torch_backend.norm import FusedRMSNorm, fuse_rms_norms, is_llama_rms_norm
from tests.models import save_tiny_llama


@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("rows", [1, 8, 300])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_fused_norm_is_bit_identical_in_float32(hidden: int, rows: int, scale: float) -> None:
    torch.manual_seed(rows)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data.normal_()
    fused = FusedRMSNorm(norm.weight, norm.variance_epsilon)
    x = torch.randn(1, rows, hidden) * scale
    strided = (torch.randn(1, rows, hidden + 7) * scale)[..., :hidden]
    with torch.inference_mode():
        for inp in (x, strided):
            assert torch.equal(fused(inp), norm(inp))


def test_only_llamas_formula_is_recognised() -> None:
    assert is_llama_rms_norm(LlamaRMSNorm(8))
    assert is_llama_rms_norm(Qwen2RMSNorm(8))  # a copy of Llama's
    assert not is_llama_rms_norm(Gemma2RMSNorm(8))  # scales by (1 + weight)
    assert not is_llama_rms_norm(torch.nn.LayerNorm(8))


def test_fuse_rms_norms_keeps_the_model_output(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path), dtype=torch.float32)
    ids = torch.tensor([[3, 17, 99, 240, 5, 61]])
    with torch.inference_mode():
        before = model(ids).logits
        assert fuse_rms_norms(model) == 5  # 2 per layer and the final one
        after = model(ids).logits
    assert isinstance(model.model.norm, FusedRMSNorm)
    assert torch.equal(after, before)
