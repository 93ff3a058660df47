"""Variable-length causal attention for prompt chunks, over the paged KV pool.

Each sequence's new tokens (rows cu_seqlens[b]:cu_seqlens[b+1] of q) sit at positions
context_lens[b] - seq_len .. context_lens[b] - 1; their K/V is already in the pool
(written by the rotary kernel), after any cached prefix. So one kernel covers a whole
prompt, a later chunk of it, and a prompt after a prefix-cache hit: it reads every key
from the pool. Grid (query tiles, B, H); key j is visible from the query at position p
iff j <= p (and p - j < window with a sliding window). A quantized pool (kv_quant.py) is
dequantized in registers as in decode_attention.py: K's scale on the key's score, V's on
the key's probability, both dots in q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels import kv_quant
from lmd.engine.turbo.kernels.common import (
    LOG2E,
    add_code_values,
    code_query,
    dot_precision,
    pool_scales,
)


@triton.jit
def _softmax_step(scores, n, nmask, pos, window, m_i, l_i):  # noqa: PLR0917
    """One tile of keys n into the running softmax of the queries at `pos`: (p, the
    factor on what was summed before, the new running max and sum)."""
    visible = nmask[None, :] & (n[None, :] <= pos[:, None])
    if window > 0:
        visible = visible & (pos[:, None] - n[None, :] < window)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row may see nothing in this tile yet (window, or a padding row): keep it at 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _prefill_kernel(  # noqa: PLR0915, PLR0917  # a Triton kernel: positional arguments, one body
    q_ptr,
    kv_ptr,
    new_k_ptr,
    tables_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    out_ptr,
    stride_q_tok,
    stride_q_head,
    stride_new_tok,
    new_v_offset,
    stride_tables,
    stride_out_tok,
    stride_out_head,
    layer,
    block_size,
    stride_kv_block,
    stride_kv_layer,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    scale_log2,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NEW_KV: tl.constexpr,  # the chunk's own keys from new_k_ptr, not the pool
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    context = tl.load(context_lens_ptr + seq)
    cached = context - q_len

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mmask = m < q_len
    dmask = d < HEAD_DIM
    pos = cached + m  # [BLOCK_M] query positions
    rows = (q_start + m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
        mask=mmask[:, None] & dmask[None, :],
        other=0.0,
    )

    # Keys this tile can see: up to its last query's position, from its first query's
    # window start (rounded down to a tile).
    hi = tl.minimum(context, cached + (tile + 1) * BLOCK_M)
    lo = tl.where(window > 0, tl.maximum(cached + tile * BLOCK_M - window + 1, 0), 0)
    lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    layer_ptr = kv_ptr + layer * stride_kv_layer + (head // GROUP) * stride_kv_head
    QUANTIZED: tl.constexpr = kv_ptr.dtype.element_ty.primitive_bitwidth == 8
    if QUANTIZED:
        scale_ptr = pool_scales(kv_ptr, stride_kv_block, HEAD_DIM)
        scale_ptr += layer * (stride_kv_layer // HEAD_DIM) + head // GROUP
        q_codes = code_query(q)
    # From the pool: every key, or (NEW_KV) the cached prefix's only.
    pool_hi = tl.minimum(hi, cached) if NEW_KV else hi
    for n0 in range(lo, pool_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < pool_hi
        block = tl.load(tables_ptr + seq * stride_tables + n // block_size, mask=nmask, other=0)
        krows = block.to(tl.int64) * stride_kv_block + (n % block_size) * stride_kv_slot
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(layer_ptr + krows[:, None] + d[None, :], mask=kvmask, other=0.0)
        if not QUANTIZED:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        else:
            srows = block.to(tl.int64) * (stride_kv_block // 2) + (n % block_size) * (
                stride_kv_slot // HEAD_DIM
            )
            k_scale = tl.load(scale_ptr + srows, mask=nmask, other=0.0).to(tl.float32)
            scores = tl.dot(q_codes, tl.trans(k.to(q_codes.dtype)), input_precision=DOT_PRECISION)
            scores = scores * (k_scale * scale_log2)[None, :]
        p, alpha, m_i, l_i = _softmax_step(scores, n, nmask, pos, window, m_i, l_i)
        v = tl.load(layer_ptr + stride_kv_kv + krows[:, None] + d[None, :], mask=kvmask, other=0.0)
        if not QUANTIZED:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            v_scale = tl.load(
                scale_ptr + stride_kv_kv // HEAD_DIM + srows, mask=nmask, other=0.0
            ).to(tl.float32)
            acc = add_code_values(acc, alpha, p, v, v_scale, DOT_PRECISION)
    if NEW_KV:  # this chunk's own keys, in q's dtype as the rotary kernel left them
        new_ptr = new_k_ptr + (head // GROUP) * HEAD_DIM + d[None, :]
        for n0 in range(tl.maximum(lo, cached), hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < hi
            new_rows = (q_start + n - cached).to(tl.int64)[:, None] * stride_new_tok
            kvmask = nmask[:, None] & dmask[None, :]
            k = tl.load(new_ptr + new_rows, mask=kvmask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            p, alpha, m_i, l_i = _softmax_step(scores, n, nmask, pos, window, m_i, l_i)
            v = tl.load(new_ptr + new_v_offset + new_rows, mask=kvmask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + rows[:, None] * stride_out_tok + head * stride_out_head + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def prefill_attention(
    q: Tensor,
    kv: Tensor,
    *,
    layer: int,
    block_tables: Tensor,
    cu_seqlens: Tensor,
    context_lens: Tensor,
    max_seq_len: int,
    scale: float,
    window: int = 0,
    tiles: tuple[int, int, int] | None = None,
    kv_scales: Tensor | None = None,
    new_kv: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Causal attention of T new tokens of B sequences over their paged contexts.

    q: [T, H, D] (any token and head strides, unit stride in D); kv: [N, L, 2, S, Hkv, D]
    with these tokens' K/V already written; block_tables: [B, W] int32; cu_seqlens:
    [B + 1] int32 and context_lens: [B] int32, both on q's device; max_seq_len: the
    longest seq_len (host int, sizes the grid). Returns [T, H, D] in q's dtype.
    tiles: (queries per program, keys per step, warps), to try others than the default.
    kv_scales: None, or with kv int8 | float8_e4m3fn the scales view [N, L, 2, S, Hkv]
    float16 of the same quantized pool (kv_quant.pool_views). new_kv: these tokens' K
    and V as written into the pool, [T, Hkv, D] each, two views of one tensor (the
    rotated qkv's k and v heads): their keys are read from there and only the cached
    prefix's from the pool (with a quantized pool: the prompt's own keys unquantized,
    and no codes to convert).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, _, block_size, num_kv_heads, kv_dim = kv.shape
    if kv_dim != head_dim or num_heads % num_kv_heads or q.stride(2) != 1:
        raise ValueError(f"q {tuple(q.shape)} does not fit the KV pool {tuple(kv.shape)}")
    if kv_scales is not None:  # the kernel finds them through kv (common.pool_scales)
        kv_quant.check_scales(kv, kv_scales)
    elif kv.dtype in kv_quant.CODE_DTYPES:
        raise kv_quant.missing_scales(kv)
    new_k, stride_new, v_offset = _new_kv(q, kv, new_kv)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    # One-byte codes take wider key tiles (H100, Llama-3-8B heads: 64 x 64 beat 64 x 32).
    wide_n = 128 if kv_scales is not None else 64
    block_m, block_n, num_warps = tiles or (
        64 if block_d <= 128 else 32,
        64 if block_d <= wide_n else 32,
        4,
    )
    grid = (triton.cdiv(max_seq_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        kv,
        new_k,
        block_tables,
        cu_seqlens,
        context_lens,
        out,
        q.stride(0),
        q.stride(1),
        stride_new,
        v_offset,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        layer,
        block_size,
        *kv.stride()[:5],  # block, layer, k/v, slot, head (head_dim is contiguous)
        scale * LOG2E,
        window,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        NEW_KV=new_kv is not None,
        num_warps=num_warps,
        num_stages=2,
    )
    return out


def _new_kv(q: Tensor, kv: Tensor, new_kv: tuple[Tensor, Tensor] | None) -> tuple[Tensor, int, int]:
    """(k, its token stride, v's offset from k in elements) for the kernel; q itself and
    zeros without new_kv."""
    if new_kv is None:
        return q, 0, 0
    k, v = new_kv
    num_kv_heads, head_dim = kv.shape[4], kv.shape[5]
    shape = (q.shape[0], num_kv_heads, head_dim)
    if (
        k.shape != shape
        or v.shape != shape
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or k.stride() != v.stride()
        or k.stride()[1:] != (head_dim, 1)
        or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    ):
        raise ValueError(
            f"new_kv: k and v [T, Hkv, D] = {list(shape)} in {q.dtype}, contiguous heads, "
            f"views of one tensor; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    return k, k.stride(0), int(v.storage_offset() - k.storage_offset())
