"""The gated MLP's activation in one pass: silu(gate) * up, or (Gemma) the tanh form
of GELU, gelu(gate) * up (transformers' gelu_pytorch_tanh); silu_and_mul_fp8 makes the
result's e4m3 codes (per token, or per 128-group) for an FP8 down projection in the
same launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.fp8_quant import e4m3_codes, group_codes, row_scale
from lmd.engine.turbo.quant.fp8 import Fp8Rows

BLOCK = 1024
# silu_and_mul_fp8 holds a row of up to this many outputs in its program's registers
# (16 warps); a wider one goes in chunks of FP8_CHUNK, twice (the second read of a row
# from HBM, since ~1,000 programs' rows in flight do not fit L2). Per-group codes go
# in chunks, once (a chunk is a whole number of 128-groups).
FP8_ONE_PASS = 16384
FP8_CHUNK = 2048


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
def _silu_and_mul_fp8_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    codes_ptr,
    scale_ptr,
    stride_x,
    stride_codes,
    width,
    GELU: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A program per row. ONE_PASS (BLOCK >= width): the row's activation in registers,
    its absmax, its codes. Else the absmax chunk by chunk, then each chunk's activation
    again for its codes (gate | up read twice)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_x
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        y = _rounded(row_ptr, 0, width, width, GELU, BLOCK)
        scale, inverse = row_scale(tl.max(tl.abs(y), axis=0))
        tl.store(codes_ptr + row * stride_codes + cols, e4m3_codes(y, inverse), mask=cols < width)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, width, BLOCK):
            amax = tl.maximum(amax, tl.abs(_rounded(row_ptr, c0, width, width, GELU, BLOCK)))
        scale, inverse = row_scale(tl.max(amax, axis=0))
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            codes = e4m3_codes(_rounded(row_ptr, c0, width, width, GELU, BLOCK), inverse)
            tl.store(codes_ptr + row * stride_codes + cols, codes, mask=cols < width)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _rounded(row_ptr, c0, width, limit, GELU: tl.constexpr, BLOCK: tl.constexpr):  # noqa: PLR0917
    """act(gate) * up of columns c0.. as silu_and_mul stores it (x's dtype), in float32;
    zeros from column `limit` on (width, or 0 for a padding row)."""
    cols = c0 + tl.arange(0, BLOCK)
    mask = cols < limit
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0)
    up = tl.load(row_ptr + width + cols, mask=mask, other=0.0)
    return gated(gate, up, GELU).to(row_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_and_mul_groups_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    codes_ptr,
    scale_ptr,
    num_rows,
    stride_x,
    stride_codes,
    stride_scale,
    width,
    GELU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A program per row of codes (zeros from num_rows on), one pass: each chunk of BLOCK
    outputs (a multiple of 128) is a whole number of groups, with its groups' scales."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_x
    limit = tl.where(row < num_rows, width, 0)
    for c0 in range(0, width, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        y = _rounded(row_ptr, c0, width, limit, GELU, BLOCK)
        codes, scale = group_codes(y, BLOCK)
        tl.store(codes_ptr + row * stride_codes + cols, codes, mask=cols < width)
        g = c0 // 128 + tl.arange(0, BLOCK // 128)
        tl.store(scale_ptr + g * stride_scale + row, scale, mask=g * 128 < width)


@triton.jit
def gate_up_rows(pid, n, BLOCK_N: tl.constexpr):
    """The rows of a gate | up weight (n = 2I rows) for program `pid`'s BLOCK_N / 2
    outputs, each output's gate and up side by side (gate_0, up_0, gate_1, ...):
    (rows [BLOCK_N], valid: the row's output exists). A product over them yields pairs
    to split (tl.reshape(..., 2)) into act(gate) * up, in one launch."""
    r = tl.arange(0, BLOCK_N)
    outs = pid * (BLOCK_N // 2) + r // 2
    return outs + (r % 2) * (n // 2), outs < n // 2


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
    num_rows, width = _checked(x, activation)
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


def silu_and_mul_fp8(x: Tensor, activation: str = "silu", *, group: int | None) -> Fp8Rows:
    """silu_and_mul's output quantized in the same launch, per token (group None) or per
    128-group (group 128): what fp8_quant.quantize_per_token(silu_and_mul(x, activation)),
    or quantize_per_token_group(..., 4), returns, bit for bit."""
    num_rows, width = _checked(x, activation)
    gelu = activation == "gelu_tanh"
    out = Fp8Rows.empty(num_rows, width, group, x.device)
    codes, scale = out.codes, out.scale
    if group is not None and len(codes):
        _silu_and_mul_groups_kernel[(len(codes),)](
            x, codes, scale, num_rows, x.stride(0), codes.stride(0), scale.stride(1), width,
            GELU=gelu, BLOCK=FP8_CHUNK, num_warps=4,
        )  # fmt: skip
    elif group is None and num_rows:
        one_pass = width <= FP8_ONE_PASS
        block = triton.next_power_of_2(width) if one_pass else FP8_CHUNK
        _silu_and_mul_fp8_kernel[(num_rows,)](
            x, codes, scale, x.stride(0), codes.stride(0), width,
            GELU=gelu, ONE_PASS=one_pass, BLOCK=block, num_warps=min(16, max(4, block // 512)),
        )  # fmt: skip
    return out


def _checked(x: Tensor, activation: str) -> tuple[int, int]:
    """(T, I) of gate | up x [T, 2I]."""
    check_activation(activation)
    num_rows, double = x.shape
    if double % 2 or x.stride(1) != 1:
        raise ValueError("silu_and_mul needs [T, 2I] with unit-stride rows")
    return num_rows, double // 2
