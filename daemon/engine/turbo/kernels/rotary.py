"""Rotary embedding of q and k, fused with the write of k and v into the paged KV pool.

Programs per token (its q heads in groups, then its k and v): q and k are rotated in
place inside the fused qkv projection output (attention reads q from there, and a
prompt its own k and v), and k is stored rotated with v into the token's slot of this
layer in the block-major pool. With per-head norm weights (Qwen3, Gemma 3), each q and
k head is first RMS-normalized over head_dim and scaled by its weight. Rotation is
transformers' "rotate half" form: for a head x = [x1, x2] (halves of head_dim) and
frequency i,
    out1 = x1 * cos - x2 * sin,   out2 = x2 * cos + x1 * sin.
Into a quantized pool (kv_quant.py) each k and v head is quantized from float32 as it
is stored: its float16 scale, then its int8 or e4m3 codes, both rounded half to even as
torch rounds them (kv_quant.quantize_heads is the reference).

For one token (a batch-1 step) the same functions run inside the qkv product's launch
instead (`Rotary`, vector_gemv's `rotary`): the last program to finish each head's
columns does that head (`rotate_head_when_last`), one launch fewer a layer; for a decode
step of more tokens, inside decode attention's launch (decode_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels import kv_quant
from lmd.engine.turbo.kernels.common import pool_scales, store_codes

# A token's q heads are spread over programs of this many (a power of two; 0: all in
# one), and its k and v take one more: at batch 1 one program did all of a token's
# heads one after another (~3 us a layer on an H200, docs/benchmarks.md).
Q_HEADS_A_PROGRAM = 8


@triton.jit
def _rotate(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _head_norm(x1, x2, w_ptr, i, im, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):  # noqa: PLR0917
    """RMSNorm of each head (a row of halves x1 | x2) with weight w: [HEAD_DIM]."""
    variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
    inv = tl.rsqrt(variance + eps)[:, None]
    w1 = tl.load(w_ptr + i, mask=im, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + i, mask=im, other=0.0).to(tl.float32)[None, :]
    return x1 * inv * w1, x2 * inv * w2


@triton.jit
def rotated_heads(  # noqa: PLR0917  # Triton functions take positional arguments
    row, h, hm, cos, sin, w_ptr, i, im, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr
):
    """Heads h (mask hm) of a token's qkv row rotated, RMS-normalized first with weight w
    where NORM: float32 halves [BLOCK_H, BLOCK_HALF] each, not stored."""
    HALF: tl.constexpr = HEAD_DIM // 2
    mask = hm[:, None] & im[None, :]
    x1_ptr = row + h[:, None] * HEAD_DIM + i[None, :]
    x1 = tl.load(x1_ptr, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    x2 = tl.load(x1_ptr + HALF, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if NORM:
        x1, x2 = _head_norm(x1, x2, w_ptr, i, im, eps, HEAD_DIM, HALF)
    return _rotate(x1, x2, cos, sin)


@triton.jit
def _rotate_heads(  # noqa: PLR0917  # Triton functions take positional arguments
    row, h, hm, cos, sin, w_ptr, i, im, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr
):
    """`rotated_heads`, stored in place."""
    HALF: tl.constexpr = HEAD_DIM // 2
    mask = hm[:, None] & im[None, :]
    x1_ptr = row + h[:, None] * HEAD_DIM + i[None, :]
    o1, o2 = rotated_heads(row, h, hm, cos, sin, w_ptr, i, im, eps, HEAD_DIM, NORM)
    tl.store(x1_ptr, o1.to(row.dtype.element_ty), mask=mask)
    tl.store(x1_ptr + HALF, o2.to(row.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_cache_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    qkv_ptr,
    positions_ptr,
    slots_ptr,
    rope_ptr,
    kv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    stride_qkv,
    stride_rope,
    layer,
    block_size,
    stride_kv_block,
    stride_kv_layer,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    Q_PROGRAMS: tl.constexpr,  # programs a token for its q heads, BLOCK_H each
):
    HALF: tl.constexpr = HEAD_DIM // 2
    # k and v in a program of their own after the q heads' where these take several
    KV_PROGRAM: tl.constexpr = Q_PROGRAMS if Q_PROGRAMS > 1 else 0
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    pos = tl.load(positions_ptr + token)
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    cos = tl.load(rope_ptr + pos * stride_rope + i, mask=im, other=0.0)[None, :]
    sin = tl.load(rope_ptr + pos * stride_rope + HALF + i, mask=im, other=0.0)[None, :]
    row = qkv_ptr + token * stride_qkv

    if part < Q_PROGRAMS:
        h = part * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(
            row, h, h < NUM_HEADS, cos, sin, q_norm_ptr, i, im, eps, HEAD_DIM, HAS_QK_NORM
        )
    if part == KV_PROGRAM:
        kh = tl.arange(0, BLOCK_KVH)
        write_kv_heads(  # all of the token's k and v heads
            row, kh, cos, sin, slots_ptr + token, kv_ptr, k_norm_ptr, i, im, eps, layer,
            block_size, stride_kv_block, stride_kv_layer, stride_kv_kv, stride_kv_slot,
            stride_kv_head, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HAS_QK_NORM,
        )  # fmt: skip


@triton.jit
def write_kv_heads(  # noqa: PLR0917  # Triton functions take positional arguments
    row,
    kh,
    cos,
    sin,
    slot_ptr,
    kv_ptr,
    k_norm_ptr,
    i,
    im,
    eps,
    layer,
    block_size,
    stride_kv_block,
    stride_kv_layer,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
):
    """KV heads kh (a vector; those < NUM_KV_HEADS) of a token's qkv row: k normed,
    rotated in place and stored with v into the token's slot of the pool (quantized into
    a pool of codes). The loads read L2 (.cg): where the qkv product's own programs wrote
    the row in the same launch, not L1."""
    HALF: tl.constexpr = HEAD_DIM // 2
    # a negative slot is a padding row (CUDA graphs): nothing stored into the pool
    slot = tl.load(slot_ptr).to(tl.int64)  # block * stride needs 64 bits
    block = tl.maximum(slot, 0) // block_size
    offset = tl.maximum(slot, 0) % block_size
    dst = kv_ptr + block * stride_kv_block + layer * stride_kv_layer + offset * stride_kv_slot
    heads_mask = (kh < NUM_KV_HEADS)[:, None] & im[None, :]
    k1_ptr = row + NUM_HEADS * HEAD_DIM + kh[:, None] * HEAD_DIM + i[None, :]
    k1 = tl.load(k1_ptr, mask=heads_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    k2 = tl.load(k1_ptr + HALF, mask=heads_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    kmask = heads_mask & ((kh * 0 + slot) >= 0)[:, None]  # stores only for a real slot
    if HAS_QK_NORM:
        k1, k2 = _head_norm(k1, k2, k_norm_ptr, i, im, eps, HEAD_DIM, HALF)
    o1, o2 = _rotate(k1, k2, cos, sin)
    # k rotated in place too: a prompt's attention reads its own keys from qkv
    # (prefill_attention's new_kv) rather than back from a quantized pool.
    tl.store(k1_ptr, o1.to(row.dtype.element_ty), mask=heads_mask)
    tl.store(k1_ptr + HALF, o2.to(row.dtype.element_ty), mask=heads_mask)
    k_dst = dst + kh[:, None] * stride_kv_head + i[None, :]
    v_src = k1_ptr + NUM_KV_HEADS * HEAD_DIM
    v_dst = k_dst + stride_kv_kv
    if kv_ptr.dtype.element_ty.primitive_bitwidth != 8:
        tl.store(k_dst, o1.to(kv_ptr.dtype.element_ty), mask=kmask)
        tl.store(k_dst + HALF, o2.to(kv_ptr.dtype.element_ty), mask=kmask)
        tl.store(v_dst, tl.load(v_src, mask=kmask, cache_modifier=".cg"), mask=kmask)
        tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kmask, cache_modifier=".cg"), mask=kmask)
    else:
        # Into a quantized pool (kv_quant.py): codes, and each head's scale.
        scale_dst = (
            pool_scales(kv_ptr, stride_kv_block, HEAD_DIM)
            + block * (stride_kv_block // 2)
            + layer * (stride_kv_layer // HEAD_DIM)
            + offset * (stride_kv_slot // HEAD_DIM)
            + kh
        )
        smask = (kh < NUM_KV_HEADS) & ((kh * 0 + slot) >= 0)
        v1 = tl.load(v_src, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        v2 = tl.load(v_src + HALF, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        store_codes(k_dst, scale_dst, o1, o2, kmask, smask, HALF)
        store_codes(v_dst, scale_dst + stride_kv_kv // HEAD_DIM, v1, v2, kmask, smask, HALF)


@triton.jit
def rotate_head_when_last(  # noqa: PLR0917  # Triton functions take positional arguments
    row,
    first_col,
    counts_ptr,
    positions_ptr,
    slots_ptr,
    rope_ptr,
    kv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    layer,
    block_size,
    stride_kv_block,
    stride_kv_layer,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """In a one-token qkv product whose programs each write BLOCK_N columns (from
    first_col) of the row, a divisor of HEAD_DIM: after its columns, each program
    counts itself done on its head's counter (q head h: counts[h]; KV head j's k and v:
    counts[NUM_HEADS + j], int32s at 0), and the one that counts last does
    `rotary_and_cache_write`'s work for that head (a KV head's k and v together), then
    resets the counter for the next launch."""
    head = first_col // HEAD_DIM
    is_q = head < NUM_HEADS
    kv_head = (head - NUM_HEADS) % NUM_KV_HEADS
    counter = counts_ptr + tl.where(is_q, head, NUM_HEADS + kv_head)
    parts = tl.where(is_q, 1, 2) * (HEAD_DIM // BLOCK_N)
    tl.debug_barrier()  # every thread's columns stored before the count
    if tl.atomic_add(counter, 1, sem="acq_rel") == parts - 1:
        tl.store(counter, 0)
        HALF: tl.constexpr = HEAD_DIM // 2
        i = tl.arange(0, HALF)
        im = i < HALF
        pos = tl.load(positions_ptr)
        cos = tl.load(rope_ptr + pos * HEAD_DIM + i)[None, :]
        sin = tl.load(rope_ptr + pos * HEAD_DIM + HALF + i)[None, :]
        if is_q:
            h = head + tl.arange(0, 1)
            _rotate_heads(
                row, h, h < NUM_HEADS, cos, sin, q_norm_ptr, i, im, eps, HEAD_DIM, HAS_QK_NORM
            )
        else:
            write_kv_heads(
                row, kv_head + tl.arange(0, 1), cos, sin, slots_ptr, kv_ptr, k_norm_ptr, i, im,
                eps, layer, block_size, stride_kv_block, stride_kv_layer, stride_kv_kv,
                stride_kv_slot, stride_kv_head, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HAS_QK_NORM,
            )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Rotary:
    """What a step's qkv rows are rotated with and where their k and v go (the arguments
    of `rotary_and_cache_write`, which the module docstring and `apply` describe), and
    `counts`: int32 zeros of at least H + Hkv, left at 0, where a one-token product does
    the work in its own launch (vector_gemv's `rotary`, `rotate_head_when_last`)."""

    positions: Tensor
    slot_mapping: Tensor
    rope: Tensor
    kv: Tensor
    layer: int
    num_heads: int
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    eps: float = 1e-6
    kv_scales: Tensor | None = None
    counts: Tensor | None = None

    def apply(self, qkv: Tensor) -> None:
        """Rotate q and k in place and store rotated k and v into the pool, in a launch
        of its own.

        qkv: [T, (H + 2 Hkv) * D], rows q heads | k heads | v heads (the fused
        projection); positions: [T] int64; slot_mapping: [T] int64, block * block_size +
        offset (< 0: skip); rope: [max_positions, D] float32, cos of the D/2 frequencies
        | their sin; kv: [N, L, 2, S, Hkv, D] (the pool; written at `layer`); q_norm,
        k_norm: [D] each or both None, the weights of an RMSNorm (epsilon `eps`) over
        each head before rotation. kv_scales: None, or with kv int8 | float8_e4m3fn the
        scales view [N, L, 2, S, Hkv] float16 of the same quantized pool
        (kv_quant.pool_views): k and v are quantized per head as they are stored."""
        if qkv.stride(1) != 1:
            raise ValueError("qkv's rows need unit stride")
        num_tokens = qkv.shape[0]
        num_kv_heads, head_dim = self.heads_of(qkv.shape[1])
        if num_tokens == 0:
            return
        block_h = triton.next_power_of_2(self.num_heads)
        if Q_HEADS_A_PROGRAM:
            block_h = min(block_h, Q_HEADS_A_PROGRAM)
        q_programs = triton.cdiv(self.num_heads, block_h)
        _rotary_cache_kernel[(num_tokens, q_programs + (q_programs > 1))](
            qkv,
            *self.tensor_args(),
            self.eps,
            qkv.stride(0),
            self.rope.stride(0),
            *self.pool_args(),
            NUM_HEADS=self.num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=block_h,
            BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            HAS_QK_NORM=self.q_norm is not None,
            Q_PROGRAMS=q_programs,
            num_warps=4,
        )

    def heads_of(self, width: int) -> tuple[int, int]:
        """(Hkv, D) of the pool where a qkv row `width` wide fits it, else ValueError."""
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        _, _, _, _, num_kv_heads, head_dim = self.kv.shape
        if width != (self.num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv of {width} does not hold {self.num_heads} q heads + k + v")
        if self.kv.stride(5) != 1 or self.kv.stride(4) != head_dim or self.rope.stride(1) != 1:
            raise ValueError("the KV pool and the rope table need contiguous heads")
        if self.kv_scales is not None:  # the kernel finds them through kv (pool_scales)
            kv_quant.check_scales(self.kv, self.kv_scales)
        elif self.kv.dtype in kv_quant.CODE_DTYPES:
            raise kv_quant.missing_scales(self.kv)
        return num_kv_heads, head_dim

    def folds(self, block_n: int) -> bool:
        """Whether a one-token product whose programs write block_n columns each can do
        this work in its launch: one token, heads of a power of two that block_n
        divides, contiguous rope rows, a counter for each q head and KV head."""
        _, _, _, _, num_kv_heads, head_dim = self.kv.shape
        return (
            self.positions.shape == self.slot_mapping.shape == (1,)
            and head_dim & (head_dim - 1) == 0
            and head_dim % block_n == 0
            and self.rope.stride(0) == head_dim
            and self.counts is not None
            and self.counts.dtype == torch.int32
            and self.counts.shape[0] >= self.num_heads + num_kv_heads
        )

    def check(self, width: int, block_n: int) -> tuple[int, int]:
        """`heads_of` a qkv product `width` wide whose programs write block_n columns
        each, where it `folds` this work, else ValueError."""
        heads = self.heads_of(width)
        if not self.folds(block_n):
            raise ValueError(f"a Rotary that a product of {block_n} columns a program cannot do")
        return heads

    def tensor_args(self) -> tuple[Tensor, ...]:
        """The kernels' positions, slots, rope, kv, q_norm and k_norm arguments (the
        rope table for absent norms: not read)."""
        q_norm = self.q_norm if self.q_norm is not None else self.rope
        k_norm = self.k_norm if self.k_norm is not None else self.rope
        return self.positions, self.slot_mapping, self.rope, self.kv, q_norm, k_norm

    def pool_args(self) -> tuple[int, ...]:
        """The kernels' layer, block size and pool strides (block, layer, k/v, slot,
        head; head_dim is contiguous)."""
        return self.layer, self.kv.shape[3], *self.kv.stride()[:5]


def rotary_and_cache_write(
    qkv: Tensor,
    *,
    positions: Tensor,
    slot_mapping: Tensor,
    rope: Tensor,
    kv: Tensor,
    layer: int,
    num_heads: int,
    q_norm: Tensor | None = None,
    k_norm: Tensor | None = None,
    eps: float = 1e-6,
    kv_scales: Tensor | None = None,
) -> None:
    """Rotate q and k in place and store rotated k and v into the pool (Rotary.apply
    says how)."""
    rotary = Rotary(positions, slot_mapping, rope, kv, layer, num_heads, q_norm, k_norm, eps,
                    kv_scales)  # fmt: skip
    rotary.apply(qkv)
