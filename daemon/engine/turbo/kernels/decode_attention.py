"""Paged decode attention: one new query token per sequence over its cached context.

Grid (B, Hkv, splits): a program takes the G = H / Hkv query heads that share one KV
head (GQA: each K/V tile is loaded once for the group, and the group's [G, D] queries
make one small matrix product with it) over one split of the context. Splits let a few
long sequences fill the GPU; their partial outputs are merged by their log-sum-exp,
given `counts`, by the last of a group's splits to finish (each counts itself done on
the group's counter, as vector_gemv's router does: a launch fewer, ~1.5 us a layer at
batch 1), else by a second kernel. With one split the first kernel writes the output.

Tokens are gathered through the block table (key j: block `block_tables[b, j // S]`,
offset `j % S`), so any block size works; the rows of one key are head_dim contiguous
elements of the block-major pool. Where BLOCK_N divides the block size, tiles start on
multiples of BLOCK_N and each lies in one block: one table entry a tile, its rows one
slot stride apart (the per-key table lookups and index arithmetic were most of the
int8 kernel's instructions; docs/benchmarks.md).

Given a `Rotary` (a decode step whose qkv product left q and k unrotated), each program
rotates its group's q heads in registers and the split whose range holds the new key
rotates k and writes k and v into the pool (kernels/rotary.py's functions), then a
barrier before its loop reads them: where a launch of the rotary kernel came first.

A quantized pool (kv_quant.py: int8 or e4m3 codes, a float16 scale per key and head)
is dequantized in registers, keeping both dots in q's dtype (codes convert exactly):
K's scale multiplies the key's score, q . (c_k s_k) = (q . c_k) s_k, and V's scale the
key's probability before p @ V, sum_j p_j (c_vj s_vj) = sum_j (p_j s_vj) c_vj.
"""

from __future__ import annotations

import math

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
from lmd.engine.turbo.kernels.decode_merge import merge_group, merge_kernel
from lmd.engine.turbo.kernels.rotary import Rotary, rotated_heads, write_kv_heads

BLOCK_N = 64  # keys per tile
MAX_SPLITS = 16


@triton.jit
def _decode_kernel(  # noqa: PLR0915, PLR0917  # a Triton kernel: positional arguments, one body
    q_ptr,
    kv_ptr,
    tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counts_ptr,  # MERGE_LAST: [B Hkv] int32 at 0, left at 0
    stride_q_seq,
    stride_q_head,
    stride_tables,
    stride_out_seq,
    stride_out_head,
    layer,
    block_size,
    stride_kv_block,
    stride_kv_layer,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    scale_log2,  # softmax scale * log2(e): scores in base 2
    window,  # 0 = full attention
    positions_ptr,  # ROTARY: the tokens' positions, slots, the rope table, head norms
    slots_ptr,
    rope_ptr,
    q_norm_ptr,
    k_norm_ptr,
    head_eps,
    stride_rope,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEADS_FIRST: tl.constexpr,  # grid (Hkv, B, splits) instead of (B, Hkv, splits)
    IN_BLOCK: tl.constexpr,  # BLOCK_N divides block_size: a tile lies in one block
    MERGE_LAST: tl.constexpr,  # the group's last split to finish merges (splits > 1)
    MERGE_G: tl.constexpr,  # GROUP to a power of two
    ROTARY: tl.constexpr,  # q is a qkv row's, unrotated: rotate it, write the new k and v
    KV_HEADS: tl.constexpr,  # ROTARY: the pool's KV heads
    HAS_QK_NORM: tl.constexpr,
):
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1).to(tl.int64)
        num_kv_heads = tl.num_programs(0)
    else:
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    split = tl.program_id(2)
    context = tl.load(context_lens_ptr + seq)
    # The query is the last token (position context - 1): every key before it is visible,
    # or with a window the last `window` keys.
    first = tl.where(window > 0, tl.maximum(context - window, 0), 0)
    # Tiles from a multiple of BLOCK_N where each can lie in one block: one block-table
    # entry a tile, the tile's rows one stride apart (the keys before `first` masked).
    lo = first // BLOCK_N * BLOCK_N if IN_BLOCK else first
    per_split = tl.cdiv(tl.cdiv(context - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, context)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    if ROTARY:  # BLOCK_D is HEAD_DIM; q's heads are followed by k's and v's in its row
        HALF: tl.constexpr = HEAD_DIM // 2
        i = tl.arange(0, HALF)
        pos = tl.load(positions_ptr + seq)
        cos = tl.load(rope_ptr + pos * stride_rope + i)[None, :]
        sin = tl.load(rope_ptr + pos * stride_rope + HALF + i)[None, :]
        row = q_ptr + seq * stride_q_seq
        q1, q2 = rotated_heads(row, heads, gmask, cos, sin, q_norm_ptr, i, i < HALF, head_eps,
                               HEAD_DIM, HAS_QK_NORM)  # fmt: skip
        q12 = tl.join(q1.to(q_ptr.dtype.element_ty), q2.to(q_ptr.dtype.element_ty))
        q = tl.reshape(tl.permute(q12, (0, 2, 1)), (BLOCK_G, BLOCK_D))  # halves side by side
        if (context - 1 >= start) & (context - 1 < end):  # the split that reads the new key
            write_kv_heads(
                row, kv_head + tl.arange(0, 1), cos, sin, slots_ptr + seq, kv_ptr, k_norm_ptr,
                i, i < HALF, head_eps, layer, block_size, stride_kv_block, stride_kv_layer,
                stride_kv_kv, stride_kv_slot, stride_kv_head, GROUP * KV_HEADS, KV_HEADS,
                HEAD_DIM, HAS_QK_NORM,
            )  # fmt: skip
            tl.debug_barrier()  # stored before any thread's loads of the tile holding it
    else:
        q = tl.load(
            q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
            mask=gmask[:, None] & dmask[None, :],
            other=0.0,
        )  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    layer_ptr = kv_ptr + layer * stride_kv_layer + kv_head * stride_kv_head
    QUANTIZED: tl.constexpr = kv_ptr.dtype.element_ty.primitive_bitwidth == 8
    if QUANTIZED:
        scale_ptr = pool_scales(kv_ptr, stride_kv_block, HEAD_DIM)
        scale_ptr += layer * (stride_kv_layer // HEAD_DIM) + kv_head
        q_codes = code_query(q)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = (n >= first) & (n < end)
        if IN_BLOCK:
            block = tl.load(tables_ptr + seq * stride_tables + n0 // block_size).to(tl.int64)
            slot = n0 % block_size + tl.arange(0, BLOCK_N)
        else:
            block = tl.load(tables_ptr + seq * stride_tables + n // block_size, mask=nmask, other=0)
            block = block.to(tl.int64)
            slot = n % block_size
        rows = block * stride_kv_block + slot * stride_kv_slot
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(layer_ptr + rows[:, None] + d[None, :], mask=kvmask, other=0.0)
        if not QUANTIZED:
            scores = (
                tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            )  # [BLOCK_G, BLOCK_N]
        else:
            srows = block * (stride_kv_block // 2) + slot * (stride_kv_slot // HEAD_DIM)
            k_scale = tl.load(scale_ptr + srows, mask=nmask, other=0.0).to(tl.float32)
            scores = tl.dot(q_codes, tl.trans(k.to(q_codes.dtype)), input_precision=DOT_PRECISION)
            scores = scores * (k_scale * scale_log2)[None, :]
        scores = tl.where(nmask[None, :], scores, float("-inf"))
        # Every tile holds at least one visible key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(layer_ptr + stride_kv_kv + rows[:, None] + d[None, :], mask=kvmask, other=0.0)
        if not QUANTIZED:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            v_scale = tl.load(
                scale_ptr + stride_kv_kv // HEAD_DIM + srows, mask=nmask, other=0.0
            ).to(tl.float32)
            acc = add_code_values(acc, alpha, p, v, v_scale, DOT_PRECISION)
        m_i = m_new

    omask = gmask[:, None] & dmask[None, :]
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # part_out: [B, H, NUM_SPLITS, BLOCK_D] float32, part_lse: [B, H, NUM_SPLITS].
        # Columns past HEAD_DIM too (zeros: v's were loaded as 0), so that the merge's
        # loads of whole rows never read memory nothing wrote.
        row = (seq * (num_kv_heads * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=gmask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=gmask)
        if MERGE_LAST:
            tl.debug_barrier()  # every thread's partials stored before the count
            counter = counts_ptr + seq * num_kv_heads + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
                tl.store(counter, 0)  # for the next launch
                merge_group(
                    part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, num_kv_heads,
                    stride_out_seq, stride_out_head, GROUP, HEAD_DIM, NUM_SPLITS, MERGE_G, BLOCK_D,
                )  # fmt: skip


def decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per sequence: enough programs for about two waves over the GPU's
    multiprocessors, no more than the longest context has tiles; a power of two."""
    wanted = math.ceil(2 * num_sms / max(1, num_seqs * num_kv_heads))
    tiles = math.ceil(max(1, max_context) / BLOCK_N)
    splits = max(1, min(MAX_SPLITS, wanted, tiles))
    return 1 << (splits - 1).bit_length()


def decode_attention(
    q: Tensor,
    kv: Tensor,
    *,
    layer: int,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    window: int = 0,
    num_splits: int = 1,
    kv_scales: Tensor | None = None,
    tiles: tuple[int, int, int] | None = None,
    heads_first: bool = True,
    counts: Tensor | None = None,
    rotary: Rotary | None = None,
) -> Tensor:
    """Attention of one new token per sequence over its paged context.

    q: [B, H, D] (any row and head strides, unit stride in D); kv: [N, L, 2, S, Hkv, D];
    block_tables: [B, W] int32; context_lens: [B] int32 on q's device, tokens of each
    sequence in the pool including the new one (0 = a padding row: output zeros).
    Returns [B, H, D] in q's dtype. num_splits: a power of two (see decode_splits).
    kv_scales: None, or with kv int8 | float8_e4m3fn the scales view [N, L, 2, S, Hkv]
    float16 of the same quantized pool (kv_quant.pool_views). tiles: (keys per tile,
    warps, stages) instead of the defaults (scripts/kv_quant_bench.py --sweep).
    heads_first: launch a sequence's KV heads side by side (grid (Hkv, B, splits)),
    reading the same slots, a key's heads being adjacent in the pool: 1.02x (bf16) and
    1.09x (int8) over (B, Hkv, splits) at batch 256 on an H100, equal at 64
    (docs/benchmarks.md, quantization: `kv_quant_bench.py --orders`); False: that order.
    counts: int32 zeros of at least B * Hkv (left at 0): with splits over a 16-bit pool,
    the last split of each group merges them in the same launch (the module docstring);
    else a merge launch.
    rotary: q is the first H heads of the step's unrotated qkv rows [B, (H + 2 Hkv) D]
    (whose k and v follow it), and `rotary.apply`'s work on them is done in this launch
    (the module docstring; past ROTARY_MAX_SEQS, by rotary.apply first); its pool and
    layer are kv and `layer`.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, _, _, block_size, num_kv_heads, kv_dim = kv.shape
    if kv_dim != head_dim or num_heads % num_kv_heads or q.stride(2) != 1:
        raise ValueError(f"q {tuple(q.shape)} does not fit the KV pool {tuple(kv.shape)}")
    if rotary is not None and not _rotates(rotary, q, kv, layer):
        rotary.apply(q.as_strided((num_seqs, q.stride(0)), (q.stride(0), 1)))  # the rows
        rotary = None
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if kv_scales is not None:  # the kernel finds them through kv (common.pool_scales)
        kv_quant.check_scales(kv, kv_scales)
    elif kv.dtype in kv_quant.CODE_DTYPES:
        raise kv_quant.missing_scales(kv)
    group = num_heads // num_kv_heads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Codes go through a conversion before each dot: half the warps, twice the programs
    # per SM, hide it better (H100, Llama-3-8B heads, 1k context: up to 30%).
    block_n, num_warps, num_stages = tiles or (BLOCK_N, 4 if kv_scales is None else 2, 2)
    if num_splits > 1:
        part_out = torch.empty(
            num_seqs * num_heads * num_splits, block_d, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            num_seqs * num_heads * num_splits, dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused
    # (not over a pool of codes: its kernel's 2 warps would spill holding the partials)
    merge_last = (
        num_splits > 1
        and counts is not None
        and _fits(counts, num_seqs * num_kv_heads)
        and kv_scales is None
    )
    grid = (num_kv_heads, num_seqs) if heads_first else (num_seqs, num_kv_heads)
    _decode_kernel[(*grid, num_splits)](
        q,
        kv,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        counts if merge_last else context_lens,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        layer,
        block_size,
        *kv.stride()[:5],  # block, layer, k/v, slot, head (head_dim is contiguous)
        scale * LOG2E,
        window,
        *_rotary_args(rotary, context_lens),
        GROUP=group,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        HEADS_FIRST=heads_first,
        IN_BLOCK=block_size % block_n == 0,
        MERGE_LAST=merge_last,
        MERGE_G=triton.next_power_of_2(group),
        ROTARY=rotary is not None,
        KV_HEADS=num_kv_heads,
        HAS_QK_NORM=rotary is not None and rotary.q_norm is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1 and not merge_last:
        merge_kernel[(num_seqs, num_kv_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            GROUP=group,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_G=triton.next_power_of_2(group),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


# Past this many sequences the rotary's own launch first is faster than the rotary in the
# attention's (kv_quant_bench.py --rotary on an H200, context 640: 64 sequences 46.5 us
# against 49.5 in bf16, even in int8; 256: 172.7 against 169.9 in bf16, 195 against 176).
ROTARY_MAX_SEQS = 64


def _rotates(rotary: Rotary, q: Tensor, kv: Tensor, layer: int) -> bool:
    """Whether the kernel does `rotary`'s work for q (the heads of qkv rows, checked):
    heads of a power of two from 16 (BLOCK_D is the head), the rotary's own pool, at most
    ROTARY_MAX_SEQS sequences."""
    num_seqs, num_heads, head_dim = q.shape
    width = q.stride(0)
    rotary.heads_of(width)  # raises where the rows are not the pool's qkv
    if (
        rotary.kv is not kv
        or rotary.layer != layer
        or rotary.num_heads != num_heads
        or q.stride(1) != head_dim
        or rotary.positions.shape != (num_seqs,)
        or rotary.slot_mapping.shape != (num_seqs,)
    ):
        raise ValueError("decode_attention's rotary: q the heads of its qkv rows, its pool")
    return num_seqs <= ROTARY_MAX_SEQS and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _rotary_args(rotary: Rotary | None, unused: Tensor) -> tuple[Tensor | float | int, ...]:
    """The kernel's positions, slots, rope, q_norm, k_norm, head_eps and stride_rope."""
    if rotary is None:
        return (unused,) * 5 + (0.0, 0)
    positions, slots, rope, _, q_norm, k_norm = rotary.tensor_args()
    return positions, slots, rope, q_norm, k_norm, rotary.eps, rope.stride(0)


def _fits(counts: Tensor, groups: int) -> bool:
    if counts.dtype != torch.int32 or counts.dim() != 1:
        raise ValueError("decode_attention's counts: int32 zeros [n]")
    return counts.shape[0] >= groups
