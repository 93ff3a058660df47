"""The gated MLP's activation in one pass: silu(gate) * up, or (Gemma) the tanh form
of GELU, gelu(gate) * up (transformers' gelu_pytorch_tanh)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    width,
    GELU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0)
    y = gated(gate, up, GELU)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated(gate, up, GELU: tl.constexpr):
    """act(gate) * up in float32 (kernels/vector_gemv.py also applies it to its output)."""
    gate = gate.to(tl.float32)
    if GELU:  # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * inner)
    else:
        act = gate * tl.sigmoid(gate)
    return act * up.to(tl.float32)


def check_activation(activation: str) -> None:
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"activation {activation!r} is not silu or gelu_tanh")


def silu_and_mul(x: Tensor, activation: str = "silu") -> Tensor:
    """x: [T, 2I] (gate | up, the fused projection's output) -> [T, I];
    `activation`: "silu" or "gelu_tanh"."""
    check_activation(activation)
    num_rows, double = x.shape
    if double % 2 or x.stride(1) != 1:
        raise ValueError("silu_and_mul needs [T, 2I] with unit-stride rows")
    width = double // 2
    out = torch.empty(num_rows, width, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(width, BLOCK))
    _silu_and_mul_kernel[grid](
        x,
        out,
        x.stride(0),
        out.stride(0),
        width,
        GELU=activation == "gelu_tanh",
        BLOCK=BLOCK,
    )
    return out
