"""The KV pool's bytes: how big a block is, and the views of a quantized pool.

Shared by the pool (kv_pool.py) and the backends' checks (backend.py); pure, no I/O.
A quantized pool (`kv_cache_dtype` int8 or fp8) holds in each block its values, one byte
each, laid out [L, 2, S, Hkv, D], then their scales, float16 [L, 2, S, Hkv] (one per
token and head; value = code * scale).
"""

from __future__ import annotations

import torch

# The element type of each quantized KV dtype's values, and of their scales.
QUANT_KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
KV_SCALE_DTYPE = torch.float16


def bytes_per_block(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes of one block: k and v of `block_size` tokens for every layer (in `dtype`,
    or quantized with their scales when `kv_cache_dtype` is int8 or fp8)."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("block_size", block_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    vectors = num_layers * 2 * block_size * num_kv_heads  # one per token, head, k|v
    if kv_cache_dtype == "auto":
        return vectors * head_dim * dtype.itemsize
    return vectors * (head_dim * QUANT_KV_DTYPES[kv_cache_dtype].itemsize + KV_SCALE_DTYPE.itemsize)


def quantized_views(
    raw: torch.Tensor, num_blocks: int, shape: tuple[int, int, int, int], kv_cache_dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The values and scales of a quantized pool over `raw` (flat uint8, at least
    num_blocks blocks): kv [N, L, 2, S, Hkv, D] int8|e4m3 and kv_scales [N, L, 2, S, Hkv]
    float16. `shape` is (L, S, Hkv, D)."""
    num_layers, block_size, num_kv_heads, head_dim = shape
    values = num_layers * 2 * block_size * num_kv_heads * head_dim
    per_block = bytes_per_block(
        num_layers, num_kv_heads, head_dim, block_size, torch.uint8, kv_cache_dtype=kv_cache_dtype
    )
    blocks = raw[: num_blocks * per_block].view(num_blocks, per_block)
    kv = blocks[:, :values].view(QUANT_KV_DTYPES[kv_cache_dtype])
    scales = blocks[:, values:].view(KV_SCALE_DTYPE)
    return (
        kv.view(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim),
        scales.view(num_blocks, num_layers, 2, block_size, num_kv_heads),
    )
