"""The merge of decode attention's context splits (decode_attention.py): each q head's
output from its splits' partial outputs, each split weighted by its share of the
softmax (their log-sum-exp). Run by the last split of a (sequence, KV head) group to
finish, in the attention's own launch, or by `merge_kernel`, a launch of its own.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_group(  # noqa: PLR0917  # a Triton function: positional arguments
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    seq,
    kv_head,
    num_kv_heads,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The outputs of a (sequence, KV head) group's q heads from their splits' partials,
    each split weighted by its share of the softmax; the group's partials loaded at once.
    The loads read L2 (.cg): in the decode kernel's own launch, other programs wrote them."""
    g = tl.arange(0, BLOCK_G)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    heads = kv_head * GROUP + g
    rows = (seq * (num_kv_heads * GROUP) + heads)[:, None] * NUM_SPLITS + s[None, :]  # [G, S]
    lse = tl.load(part_lse_ptr + rows, mask=gmask[:, None], other=0.0, cache_modifier=".cg")
    m = tl.max(lse, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty sequence (a padding row)
    w = tl.exp2(lse - m[:, None])  # empty splits weigh 0
    total = tl.sum(w, axis=1)
    parts = tl.load(
        part_out_ptr + rows[:, :, None] * BLOCK_D + d[None, None, :],
        mask=gmask[:, None, None],
        other=0.0,
        cache_modifier=".cg",
    )  # [G, S, D]
    out = tl.sum(parts * w[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]
    dst = out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (d < HEAD_DIM)[None, :])


@triton.jit
def merge_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    merge_group(
        part_out_ptr, part_lse_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1),
        tl.num_programs(1), stride_out_seq, stride_out_head, GROUP, HEAD_DIM, NUM_SPLITS,
        BLOCK_G, BLOCK_D,
    )  # fmt: skip
