"""Small things the kernels share."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lmd.engine.turbo.kernels.kv_quant import SCALE_MIN as _SCALE_MIN

SCALE_MIN = tl.constexpr(_SCALE_MIN)

LOG2E = 1.4426950408889634  # scores are scaled by log2(e) so that exp2 replaces exp


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: true float32 for a float32 model (Triton's default,
    tf32, keeps 10 mantissa bits); half-precision inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def pool_scales(kv_ptr, stride_kv_block, HEAD_DIM: tl.constexpr):
    """Block 0's float16 scales in a quantized pool (kv_quant.py), from its data pointer:
    they follow the block's L * 2 * S * Hkv * D codes, D / (D + 2) of its bytes. In that
    layout the scales' strides are the data's over D (block: over 2 bytes), so the
    kernels take no pointer or strides of their own for them."""
    data_bytes = stride_kv_block // (HEAD_DIM + 2) * HEAD_DIM
    return (kv_ptr + data_bytes).to(tl.pointer_type(tl.float16))


@triton.jit
def code_query(q):
    """q as a quantized pool's dots take it: float16 (saturated at its range), since e4m3
    and int8 codes become float16 in one instruction a pair where bfloat16 went through
    float32 (three; ~16% of the fp8 decode kernel's instructions on sm_90). A float32
    model's q stays float32 (exact dots, as dot_precision says)."""
    if q.dtype == tl.float32:  # one return: compiled, both would be typed (Triton 3.6)
        codes = q
    else:
        codes = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return codes


@triton.jit
def add_code_values(acc, alpha, p, v, v_scale, PRECISION: tl.constexpr):  # noqa: PLR0917
    """acc * alpha + p @ (v codes, each key's row times its v_scale), the dot in float16
    (float32 where PRECISION is "ieee": a float32 model). p is scaled by each key's
    v_scale over the tile's largest, so its values stay in [0, 1] (under float16's normal
    range only for terms < 6e-5 of the tile's largest: absolute errors ~3e-8), and the
    product by that largest after."""
    DOT: tl.constexpr = tl.float32 if PRECISION == "ieee" else tl.float16
    top = tl.maximum(tl.max(v_scale, axis=0), 1e-30)
    pv = (p * (v_scale / top)[None, :]).to(DOT)
    return acc * alpha[:, None] + tl.dot(pv, v.to(DOT), input_precision=PRECISION) * top


@triton.jit
def _round_half_even(a):
    """a >= 0 rounded to an integer, ties to even (a - floor(a) is exact for a >= 0)."""
    r = tl.floor(a)
    frac = a - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


@triton.jit
def _pow2(e):
    """2^e as float32 for an int32 e in the normal range, built from its exponent bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _codes(x, scale, CODE: tl.constexpr):
    """x / scale as int8 or float8e4nv codes (CODE), rounded to nearest even.

    e4m3 is rounded on its grid in float32 (3 mantissa bits from 2^-6 on, steps of 2^-9
    below) and then cast, exactly: the cast of an inexact value rounds differently in
    Triton's interpreter than on a GPU.
    """
    y = tl.div_rn(x, scale)
    sign = y.to(tl.int32, bitcast=True) & -0x80000000  # its bit, so -0.0 stays -0.0
    a = tl.abs(y)
    if CODE.is_int8():
        r = tl.minimum(_round_half_even(a), 127.0)
    else:
        a = tl.minimum(a, 448.0)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        r = _round_half_even(a * _pow2(3 - e)) * _pow2(e - 3)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(CODE)


@triton.jit
def store_codes(dst, scale_dst, x1, x2, mask, scale_mask, HALF: tl.constexpr):  # noqa: PLR0917
    """Quantize heads (rows of halves x1 | x2, float32) into codes at dst and one float16
    scale per head at scale_dst."""
    CODE: tl.constexpr = dst.dtype.element_ty
    QMAX: tl.constexpr = 127.0 if CODE.is_int8() else 448.0
    amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))
    scale = tl.maximum(tl.div_rn(amax, QMAX), SCALE_MIN).to(tl.float16)
    s = scale.to(tl.float32)[:, None]
    tl.store(dst, _codes(x1, s, CODE), mask=mask)
    tl.store(dst + HALF, _codes(x2, s, CODE), mask=mask)
    tl.store(scale_dst, scale, mask=scale_mask)


@triton.jit
def expert_scales(ws_ptr, rows, k0, stride_sn, stride_sk, mask, SCALES: tl.constexpr):  # noqa: PLR0917
    """An FP8 expert's scales (ws_ptr at the expert's) of weight rows `rows` (any shape)
    in the K slice from k0: SCALES 1, a scale a row; 128, 128x128 blocks
    (quant/fp8_experts.py's Operands)."""
    if SCALES == 1:
        at = ws_ptr + rows.to(tl.int64) * stride_sn
    else:
        at = ws_ptr + (rows // SCALES).to(tl.int64) * stride_sn + (k0 // SCALES) * stride_sk
    return tl.load(at, mask=mask, other=0.0)
