"""Store new tokens' K and V into the paged pool, skipping padding rows (slot < 0).

The torch backend's CUDA-graph decode step writes its K/V through this kernel: a graph
replays fixed shapes, so the padding rows of a batch bucket are in every step and must
write nothing (an indexed copy cannot skip rows). One program per token.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _cache_write_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    k_ptr,
    v_ptr,
    slots_ptr,
    kv_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    layer,
    block_size,
    stride_kv_block,
    stride_kv_layer,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    real = (h * 0 + slot) >= 0  # a padding row writes nothing
    mask = ((h < NUM_KV_HEADS) & real)[:, None] & (d < HEAD_DIM)[None, :]
    block = tl.maximum(slot, 0) // block_size
    offset = tl.maximum(slot, 0) % block_size
    dst = (
        kv_ptr
        + block * stride_kv_block
        + layer * stride_kv_layer
        + offset * stride_kv_slot
        + h[:, None] * stride_kv_head
        + d[None, :]
    )
    k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_kv_kv, v, mask=mask)


def cache_write(k: Tensor, v: Tensor, slot_mapping: Tensor, kv: Tensor, layer: int) -> None:
    """k, v: [T, Hkv, D] (any token and head strides, unit stride in D) into
    kv: [N, L, 2, S, Hkv, D] at `layer`, token t at slot_mapping[t] (block * S +
    offset); a negative slot writes nothing."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1 or kv.stride(5) != 1:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} need unit-stride heads")
    if kv.shape[4:] != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)} does not fit the KV pool {tuple(kv.shape)}")
    if num_tokens == 0:
        return
    _cache_write_kernel[(num_tokens,)](
        k,
        v,
        slot_mapping,
        kv,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        layer,
        kv.shape[3],
        *kv.stride()[:5],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
