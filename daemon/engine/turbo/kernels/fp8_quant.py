"""Activations quantized to e4m3 per token (kernels/fp8.py's GEMMs take them): a row's
scale is its absmax / 448 (AMAX_FLOOR for a zero row), over the whole row or each
128-group, and its codes x * (1 / scale) rounded to e4m3.

The reciprocal is one IEEE division a row (tl.math.div_rn; `/` may be approximate), each
value one multiply (an IEEE division a value was ~15 of the fused activation's ~42
instructions a value on sm_90, with a branch), rounded to nearest, ties to even:
quant/fp8.py's quantize_per_token_ref to the bit (`.to(float8_e4m3fn)` after a clamp). On a
GPU that is the hardware's conversion (cvt.rn.satfinite, one instruction for two
values); Triton's CPU interpreter converts some values wrongly (127.99 -> 64), so there
the value is rounded to e4m3's grid in float32 first and the cast after is exact.
`row_scale` and `e4m3_codes` are what the RMSNorm and the gated activation use to make
these codes in their own launch (kernels/norm.py, kernels/activation.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.common import interpreting
from lmd.engine.turbo.quant.e4m3 import AMAX_FLOOR, FP8_MAX
from lmd.engine.turbo.quant.e4m3 import BLOCK as GROUP

_MAX, _FLOOR = tl.constexpr(FP8_MAX), tl.constexpr(AMAX_FLOOR)  # Triton reads constexprs
_INV_MAX = tl.constexpr(1.0 / FP8_MAX)  # scale = absmax * (1/448), as torch's `/ 448` on CUDA
_BY_HARDWARE = tl.constexpr(not interpreting())  # e4m3_codes: the GPU's own conversion
_GROUP = tl.constexpr(GROUP)


@triton.jit
def _round_e4m3(v):
    """v: float32 in [-448, 448] -> the nearest e4m3 value (ties to even), as float32."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # normal numbers (>= 2^-6): keep 3 of float32's 23 mantissa bits, rounding to even
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # subnormals: multiples of 2^-9; adding 2^14 rounds to float32's ulp there, 2^-9
    tiny = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, tiny, normal)
    return tl.where(v < 0, -r, r)


@triton.jit
def row_scale(amax):
    """A row's (or group's) scale from its float32 absmax, and the scale's reciprocal."""
    scale = tl.maximum(amax, _FLOOR) * _INV_MAX
    return scale, tl.math.div_rn(1.0, scale)


@triton.jit
def e4m3_codes(x, inverse):
    """float32 x times its scale's reciprocal -> e4m3 codes (float8e4nv), saturated at
    +-448."""
    v = tl.clamp(x * inverse, -_MAX, _MAX)
    if _BY_HARDWARE:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return _round_e4m3(v).to(tl.float8e4nv)


@triton.jit
def group_codes(y, BLOCK: tl.constexpr):
    """A row's values y [BLOCK] (float32; BLOCK a multiple of 128) -> (their codes
    [BLOCK], the scales of its 128-groups [BLOCK // 128])."""
    groups = tl.reshape(y, (BLOCK // _GROUP, _GROUP))
    scale, inverse = row_scale(tl.max(tl.abs(groups), axis=1))
    return tl.reshape(e4m3_codes(groups, inverse[:, None]), (BLOCK,)), scale


@triton.jit
def _quant_rows_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    q_ptr,
    scale_ptr,
    k,
    stride_x,
    stride_q,
    ONE_PASS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per row: its absmax, then its codes. A row of up to BLOCK_K is read
    once into registers (ONE_PASS); a longer one twice."""
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:
        ks = tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < k, other=0.0).to(tl.float32)
        scale, inverse = row_scale(tl.max(tl.abs(x), axis=0))
        q = e4m3_codes(x, inverse)
        tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ks < k)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_x + ks, mask=ks < k, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale, inverse = row_scale(tl.max(amax, axis=0))
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_x + ks, mask=ks < k, other=0.0).to(tl.float32)
            q = e4m3_codes(x, inverse)
            tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ks < k)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _quant_groups_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    q_ptr,
    scale_ptr,
    m,
    m_out,
    k,
    stride_x,
    stride_q,
    stride_s,
    BLOCK_M: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    """A program per (BLOCK_M rows, one K group): the rows' absmax over the group. Rows
    m..m_out (padding) get zero codes."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    ks = group * GROUP_K + tl.arange(0, GROUP_K)
    x = tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :],
        mask=(rows[:, None] < m) & (ks[None, :] < k),
        other=0.0,
    ).to(tl.float32)  # [BLOCK_M, GROUP_K]
    scale, inverse = row_scale(tl.max(tl.abs(x), axis=1))  # [BLOCK_M]
    tl.store(scale_ptr + group * stride_s + rows, scale, mask=rows < m_out)
    q = e4m3_codes(x, inverse[:, None])
    tl.store(
        q_ptr + rows.to(tl.int64)[:, None] * stride_q + ks[None, :],
        q.to(q_ptr.dtype.element_ty),
        mask=(rows[:, None] < m_out) & (ks[None, :] < k),
    )


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x: [M, K] half -> (codes [M, K] float8_e4m3fn, scale [M, 1] float32), x ~= codes *
    scale; scale = max(row absmax, AMAX_FLOOR) * (1/448)."""
    num_rows, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_per_token takes rows of unit stride")
    q = torch.empty(num_rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows:
        one_pass = k <= 4096  # longer rows in registers ran slower on an H100 (K = 14336)
        block_k = triton.next_power_of_2(k) if one_pass else 4096
        _quant_rows_kernel[(num_rows,)](
            x, q, scale, k, x.stride(0), q.stride(0), ONE_PASS=one_pass, BLOCK_K=block_k,
            num_warps=8 if k > 2048 else 4,
        )  # fmt: skip
    return q, scale


def quantize_per_token_group(x: Tensor, row_multiple: int = 1) -> tuple[Tensor, Tensor]:
    """x: [M, K] half -> (codes [M', K] float8_e4m3fn, scale [M', ceil(K/128)] float32),
    x[:, 128-group g] ~= codes[:, g] * scale[:, g], M' = M rounded up to row_multiple
    (zero rows). The scales are column-major (stride (1, M')): the GEMM reads a K block's
    scales for consecutive rows in one load, and cuBLAS's 1x128 scales want exactly that,
    with 16-byte aligned columns (row_multiple 4)."""
    num_rows, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_per_token_group takes rows of unit stride")
    padded = -(-num_rows // row_multiple) * row_multiple
    num_groups = triton.cdiv(k, GROUP)
    q = torch.empty(padded, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale_t = torch.empty(num_groups, padded, dtype=torch.float32, device=x.device)
    if padded:
        block_m = 16
        _quant_groups_kernel[(triton.cdiv(padded, block_m), num_groups)](
            x, q, scale_t, num_rows, padded, k, x.stride(0), q.stride(0), scale_t.stride(0),
            BLOCK_M=block_m, GROUP_K=GROUP, num_warps=4,
        )  # fmt: skip
    return q, scale_t.t()
