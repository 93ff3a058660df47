"""Small things the kernels share."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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
