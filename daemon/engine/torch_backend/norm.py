"""Llama-style RMSNorm modules as one `torch.rms_norm` kernel, for the torch backend on CPU.

transformers' `LlamaRMSNorm.forward` (and its copies: Qwen2, Mistral, SmolLM2's Llama...)
runs seven ops: to(float32), pow, mean, add, rsqrt, mul, mul. `torch.rms_norm` computes
the same thing in one kernel, bit for bit in float32 on CPU (checked on 60 shapes and
scales, strided inputs included; tests/unit/test_torch_backend.py keeps checking it),
in less time per call both at decode (61 norms a step for SmolLM2) and on a [1024, 576]
prefill (docs/benchmarks.md, 'CPU, second pass: oneDNN linears, block copies, malloc,
threads', and for the prefill 'Figures that code comments used to quote').

Only modules whose forward is byte-for-byte Llama's are swapped; Gemma's (1 + weight) and
any other variant keep their own.
"""

from __future__ import annotations

import logging
from types import CodeType
from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

log = logging.getLogger(__name__)


class FusedRMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps) over the last dim; x: [..., H]."""

    def __init__(self, weight: Tensor, eps: float) -> None:
        super().__init__()
        self.weight = weight  # [H], the original module's Parameter (shared, not copied)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return torch.rms_norm(x, (self.weight.shape[0],), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def _code(fn: Any) -> CodeType | None:
    code = getattr(fn, "__code__", None)
    return code if isinstance(code, CodeType) else None


def _same_code(a: CodeType | None, b: CodeType) -> bool:
    return a is not None and (a.co_code, a.co_consts, a.co_names) == (
        b.co_code,
        b.co_consts,
        b.co_names,
    )


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Does `module` compute exactly LlamaRMSNorm's formula (same forward code)?"""
    reference = _code(LlamaRMSNorm.forward)
    weight = getattr(module, "weight", None)
    return (
        reference is not None
        and _same_code(_code(type(module).forward), reference)
        and isinstance(weight, Tensor)
        and weight.ndim == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def fuse_rms_norms(model: nn.Module) -> int:
    """Swap every Llama-style RMSNorm in `model` for a FusedRMSNorm; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if is_llama_rms_norm(m)]
    for name, module in targets:
        model.set_submodule(name, FusedRMSNorm(module.weight, module.variance_epsilon))
    log.info("fused %d RMSNorm modules", len(targets))
    return len(targets)
