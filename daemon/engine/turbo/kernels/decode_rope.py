"""RopeWrite: decode attention (decode_attention.py) doing what the rotary kernel
(rotary.py) does for a decode step, one launch fewer a layer: q rotated (after its
per-head RMSNorm where the model has one) as attention loads it, and each sequence's new
key rotated and written with its value into its slot by the program whose split holds
the new position, which adds that key to its softmax from registers rather than reading
it back. 16-bit pools only (a quantized pool's keys go through the rotary kernel, which
quantizes them as it writes)."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels import kv_quant


@dataclass(frozen=True, slots=True)
class RopeWrite:
    """decode_attention's `rope`: the step's tensors the rotary kernel would have taken."""

    new_kv: Tensor  # [B, 2 Hkv, D]: the step's k | v heads (a view of qkv)
    positions: Tensor  # [B] int64
    slot_mapping: Tensor  # [B] int64 (< 0: a padding row, nothing written)
    table: Tensor  # [max_positions, D] float32, cos | sin
    q_norm: Tensor | None = None  # [D]: Qwen3's and Gemma's per-head norms, or None
    k_norm: Tensor | None = None
    eps: float = 1e-6


@triton.jit
def rope_row(row_ptr, d, HEAD_DIM: tl.constexpr):
    """cos and sin of one position for each of a head's D elements (frequency d mod D/2)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    i = d % HALF
    cos = tl.load(row_ptr + i, mask=d < HEAD_DIM, other=0.0)
    sin = tl.load(row_ptr + HALF + i, mask=d < HEAD_DIM, other=0.0)
    return cos[None, :], sin[None, :]


@triton.jit
def roped(rows, rmask, d, cos, sin, w_ptr, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):  # noqa: PLR0917
    """Heads at `rows` ([R, 1] pointers, mask rmask) rotated "rotate half" in float32,
    RMS-normalized first with weight w where NORM: [R, BLOCK_D]. rotary.py's _head_norm
    and _rotate, on whole rows (each element beside its partner in the other half)
    rather than two halves: the layout tl.dot takes q in, which two halves of a head_dim
    that is not a power of two (96) cannot be joined into."""
    HALF: tl.constexpr = HEAD_DIM // 2
    mask = rmask[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = (d + HALF) % HEAD_DIM  # the other half's element of each
    xs = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
        ws = tl.load(w_ptr + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
        x, xs = x * inv * w, xs * inv * ws
    sign = tl.where(d < HALF, -1.0, 1.0)[None, :]
    return x * cos + sign * xs * sin


@triton.jit
def new_key(  # noqa: PLR0917  # Triton functions take positional arguments
    m_i, l_i, acc, q, new_row, kv_head, num_kv_heads, slot, layer_ptr, block_size,
    stride_kv_block, stride_kv_slot, stride_kv_kv, d, cos, sin, k_norm_ptr, eps, scale_log2,
    HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    """RopeWrite's new key of one sequence and KV head: k rotated from the step's qkv
    row (`new_row`: its k | v heads), written with v into `slot` (< 0: not written), and
    added to the group's running softmax (m_i, l_i, acc) with q's scores for it."""
    dmask = (d < HEAD_DIM)[None, :]
    k_row = new_row + kv_head * HEAD_DIM + tl.zeros([1], tl.int32)  # [1]
    one = tl.full([1], 1, tl.int1)
    k = roped(k_row[:, None], one, d, cos, sin, k_norm_ptr, eps, HEAD_DIM, QK_NORM)
    k = k.to(layer_ptr.dtype.element_ty)  # [1, BLOCK_D], as the pool holds it
    v = tl.load(k_row[:, None] + num_kv_heads * HEAD_DIM + d[None, :], mask=dmask, other=0.0)
    v = v.to(k.dtype)
    if slot >= 0:
        dst = layer_ptr + slot // block_size * stride_kv_block + slot % block_size * stride_kv_slot
        tl.store(dst + d[None, :], k, mask=dmask)
        tl.store(dst + stride_kv_kv + d[None, :], v, mask=dmask)
    score = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale_log2  # [BLOCK_G]
    m_new = tl.maximum(m_i, score)
    p = tl.exp2(score - m_new)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + p, acc * alpha[:, None] + p[:, None] * v.to(tl.float32)


def check_rope(rope: RopeWrite, q: Tensor, kv: Tensor, kv_scales: Tensor | None) -> None:
    num_seqs, _, head_dim = q.shape
    num_kv_heads = kv.shape[4]
    if kv_scales is not None or kv.dtype in kv_quant.CODE_DTYPES:
        raise ValueError("decode_attention rotates and writes new keys into 16-bit pools only")
    if rope.new_kv.shape != (num_seqs, 2 * num_kv_heads, head_dim) or rope.new_kv.stride(2) != 1:
        raise ValueError(
            f"RopeWrite.new_kv is [B, 2 Hkv, D] = {[num_seqs, 2 * num_kv_heads, head_dim]} with "
            f"unit stride in D, not {list(rope.new_kv.shape)}"
        )
    if rope.new_kv.stride(1) != head_dim or rope.table.stride(1) != 1:
        raise ValueError("RopeWrite needs contiguous k | v heads and rope table rows")
    if (rope.q_norm is None) != (rope.k_norm is None):
        raise ValueError("q_norm and k_norm come together")


def rope_args(rope: RopeWrite | None, q: Tensor) -> tuple[object, ...]:
    """The kernel's RopeWrite arguments (q itself where there is none: never read)."""
    if rope is None:
        return (q, q, q, q, q, q, 0.0, 0, 0)
    norms = (rope.q_norm, rope.k_norm) if rope.q_norm is not None else (rope.table, rope.table)
    return (
        rope.new_kv,
        rope.positions,
        rope.slot_mapping,
        rope.table,
        *norms,
        rope.eps,
        rope.new_kv.stride(0),
        rope.table.stride(0),
    )
