"""A quantized KV pool: int8 or fp8 (e4m3) values with one float16 scale per token per
head, for K and for V.

The pool is one uint8 allocation of N blocks of `block_nbytes` bytes; inside a block
come first the values, then their scales:

    data:   [L, 2, S, Hkv, D] int8 | float8_e4m3fn      L * 2 * S * Hkv * D bytes
    scales: [L, 2, S, Hkv] float16                       L * 2 * S * Hkv * 2 bytes

so one block, scales included, is one run of bytes (KV migration copies it as is). The
kernels take two views of that memory (pool_views): `kv` [N, L, 2, S, Hkv, D] and
`kv_scales` [N, L, 2, S, Hkv], both with the block stride block_nbytes (in bytes).

A token's head x (D values, float32 after rotary and q/k norm) is stored as codes c and
a scale s, and reads back as c * s:

    s = float16(max(absmax(x) / QMAX, SCALE_MIN))        QMAX: 127 (int8), 448 (fp8)
    c = clamp(round(x / s), -127, 127)                   int8, round half to even
    c = e4m3(clamp(x / s, -448, 448))                    fp8, round to nearest even

with the float16 s itself in x / s, so that c * s is what was meant. This module is the
torch side (layout, views, reference quantization); the kernels (rotary.py writes,
decode_attention.py and prefill_attention.py read) do the same arithmetic in registers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmd.engine.kv_layout import QUANT_KV_DTYPES, bytes_per_block, quantized_views

KV_KINDS = ("int8", "fp8")
KV_DTYPES: dict[str, torch.dtype] = QUANT_KV_DTYPES
CODE_DTYPES = tuple(KV_DTYPES.values())
QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
# The smallest normal float16 (2^-14): a scale never rounds to 0, nor to a subnormal
# whose coarse rounding would push x / s past QMAX. An all-zero head gets codes 0.
SCALE_MIN = torch.finfo(torch.float16).tiny


def kind_of(dtype: torch.dtype) -> str | None:
    """The kind ("int8" or "fp8") of a quantized pool's data dtype, None for a model dtype."""
    for kind, kind_dtype in KV_DTYPES.items():
        if dtype == kind_dtype:
            return kind
    return None


def block_nbytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block: its codes (one byte each) and their float16 scales."""
    return bytes_per_block(
        num_layers, num_kv_heads, head_dim, block_size, torch.uint8, kv_cache_dtype="int8"
    )


def _data_strides(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """Strides of the data view [N, L, 2, S, Hkv, D] in bytes (= elements)."""
    per_slot = num_kv_heads * head_dim
    return (
        block_nbytes(num_layers, block_size, num_kv_heads, head_dim),
        2 * block_size * per_slot,
        block_size * per_slot,
        per_slot,
        head_dim,
        1,
    )


def _scale_strides(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """Strides of the scales view [N, L, 2, S, Hkv] in float16 elements."""
    return (
        block_nbytes(num_layers, block_size, num_kv_heads, head_dim) // 2,
        2 * block_size * num_kv_heads,
        block_size * num_kv_heads,
        num_kv_heads,
        1,
    )


def pool_views(  # noqa: PLR0917  # the pool's dimensions, in order
    raw: Tensor, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, kind: str
) -> tuple[Tensor, Tensor]:
    """(kv, kv_scales): the data and scales views of a contiguous uint8 pool, flat or
    [N, block_nbytes]; N = raw.numel() // block_nbytes. No copy (the engine's own
    kv_layout.quantized_views, with the checks a caller outside the engine needs)."""
    if kind not in KV_DTYPES:
        raise ValueError(f"unknown KV quantization {kind!r}: use one of {', '.join(KV_KINDS)}")
    nbytes = block_nbytes(num_layers, block_size, num_kv_heads, head_dim)
    if raw.dtype != torch.uint8 or not raw.is_contiguous() or raw.numel() % nbytes:
        raise ValueError(
            f"a quantized pool is contiguous uint8 in blocks of {nbytes} bytes, "
            f"got {raw.dtype} {tuple(raw.shape)}"
        )
    if raw.storage_offset() % 2:
        raise ValueError("a quantized pool must start at an even byte (float16 scales)")
    dims = (num_layers, block_size, num_kv_heads, head_dim)
    return quantized_views(raw.reshape(-1), raw.numel() // nbytes, dims, kind)


def quantized_pool(  # noqa: PLR0917  # the pool's dimensions, in order
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    kind: str,
    device: torch.device | str,
) -> tuple[Tensor, Tensor, Tensor]:
    """A zeroed quantized pool: (raw [N, block_nbytes] uint8, kv, kv_scales)."""
    nbytes = block_nbytes(num_layers, block_size, num_kv_heads, head_dim)
    raw = torch.zeros(num_blocks, nbytes, dtype=torch.uint8, device=device)
    kv, scales = pool_views(raw, num_layers, block_size, num_kv_heads, head_dim, kind)
    return raw, kv, scales


def scales_of(kv: Tensor) -> Tensor:
    """The kv_scales view of a quantized pool, rebuilt from its data view `kv` (same
    storage, after the block's data). Metadata only: no kernel, no copy."""
    num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv.shape
    dims = (num_layers, block_size, num_kv_heads, head_dim)
    if kind_of(kv.dtype) is None or kv.stride() != _data_strides(*dims):
        raise ValueError(
            f"{kv.dtype} {tuple(kv.shape)} with strides {kv.stride()} is not the data "
            "view of a quantized KV pool (kv_quant.pool_views makes one)"
        )
    start = kv.storage_offset() + num_layers * 2 * block_size * num_kv_heads * head_dim
    if start % 2:
        raise ValueError("a quantized pool must start at an even byte (float16 scales)")
    scales = torch.empty(0, dtype=torch.float16, device=kv.device)
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads)
    return scales.set_(kv.untyped_storage(), start // 2, shape, _scale_strides(*dims))


def check_scales(kv: Tensor, kv_scales: Tensor) -> None:
    """Raise unless kv_scales is the scales view that goes with the data view kv.

    The kernels find the scales through kv itself, after each block's data, at kv's
    strides over D (block: over 2 bytes; common.pool_scales): this makes that right.
    """
    num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv.shape
    dims = (num_layers, block_size, num_kv_heads, head_dim)
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads)
    fits = (
        kind_of(kv.dtype) is not None
        and kv.stride() == _data_strides(*dims)
        and kv_scales.dtype == torch.float16
        and kv_scales.shape == shape
        and kv_scales.stride() == _scale_strides(*dims)
        and kv_scales.data_ptr() == kv.data_ptr() + num_layers * kv.stride(1)
    )
    if not fits:
        raise ValueError(
            f"kv {kv.dtype} {tuple(kv.shape)} and kv_scales {kv_scales.dtype} "
            f"{tuple(kv_scales.shape)} are not the two views of one quantized KV pool "
            "(kv_quant.pool_views makes them)"
        )


def missing_scales(kv: Tensor) -> ValueError:
    """The error for a pool of codes passed without its scales."""
    return ValueError(f"a {kv.dtype} KV pool needs its kv_scales (kv_quant.scales_of)")


def quantize_heads(x: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """Reference quantization of heads x [..., D] (any float dtype; computed in float32):
    codes [..., D] in the kind's dtype and scales [...] float16."""
    qmax = QMAX[kind]
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / qmax).clamp_min(SCALE_MIN).half()
    y = x / scale.float()
    if kind == "int8":
        codes = y.round().clamp(-qmax, qmax).to(torch.int8)  # round: half to even
    else:
        codes = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn)
    return codes, scale.squeeze(-1)


def dequantize_heads(codes: Tensor, scale: Tensor) -> Tensor:
    """codes [..., D] int8 | float8_e4m3fn, scale [...] float16 -> float32 [..., D]."""
    return codes.float() * scale.float().unsqueeze(-1)
