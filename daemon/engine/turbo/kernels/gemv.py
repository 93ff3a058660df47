"""Skinny matrix products for small decode batches: y = x @ W^T (+ b) with x of 1-16 rows.

At batch 1-4 a decode step's GEMMs read each weight once and do almost no arithmetic, so
they should run at memory bandwidth; cuBLAS's kernels for these shapes are tuned for
larger M and leave part of it unused (docs/benchmarks.md, turbo). Here each program owns
BLOCK_N output columns: it streams their weight rows [BLOCK_N, K] once, in BLOCK_K
slices pipelined over `num_stages`, against the x rows padded to 16 (tl.dot's least M),
and accumulates in float32.

With `send` (a tensor-parallel group's batch-1 all-reduce point, turbo/exchange.py)
the one row is summed over the group by the programs themselves: each program stores
its columns of this rank's partial row, tagged with the step (kernels/tagged.py), into
this rank's slot there on every other rank (plain stores, no fence), then polls its own
memory until the other ranks' words for the same columns carry this step's tag, and
writes the sum (rank order, float32, rounded once: what NCCL's sum gives) into this
rank's row at that point. So the products after it read a plain summed row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.exchange import Point
from lmd.engine.turbo.kernels.tagged import received_row, tag

MAX_ROWS = 16


@triton.jit
def _gemv_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    num_rows,
    n,
    k,
    stride_x,
    stride_w,
    stride_y,
    word_ptrs,  # PEERS: [N] int64, every rank's exchange words [P, N, n]
    step_ptr,  # PEERS: the exchange's step count
    point,  # PEERS: the point's index p (this rank's slot: p * N + RANK)
    HAS_BIAS: tl.constexpr,
    PEERS: tl.constexpr,  # the group's size when sending, else 0
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = W rows
    rows = tl.arange(0, 16)  # x rows, padded
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :],
            mask=(rows[:, None] < num_rows) & (ks[None, :] < k),
            other=0.0,
        )  # [16, BLOCK_K]
        w = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None],
            mask=(cols[None, :] < n) & (ks[:, None] < k),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < n)
    if PEERS:
        _all_reduce(y, rows, cols, mask, y_ptr, n, word_ptrs, step_ptr, point, PEERS, RANK)
    else:
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y, mask=mask)


@triton.jit
def _all_reduce(  # noqa: PLR0917  # Triton functions take positional arguments
    y,
    rows,
    cols,
    mask,
    y_ptr,
    n,
    word_ptrs,
    step_ptr,
    point,
    PEERS: tl.constexpr,
    RANK: tl.constexpr,
):
    """Row 0 of y [16, BLOCK_N] summed over the group into y_ptr (the module docstring):
    sent first, tagged, into this rank's slot on every other rank; then the others'
    words here, waited for, added in rank order."""
    step = tl.load(step_ptr)
    words = tag(y, step)
    slots = point * PEERS  # point: maybe a constant (when 1)
    for q in tl.static_range(PEERS):
        if q != RANK:
            dst = tl.load(word_ptrs + q).to(tl.pointer_type(words.dtype)) + (slots + RANK) * n
            tl.store(dst + rows[:, None] * 0 + cols[None, :], words, mask=mask)
    here = tl.load(word_ptrs + RANK).to(tl.pointer_type(words.dtype))
    valid = cols < n
    total = tl.zeros(cols.shape, dtype=tl.float32)
    for q in tl.static_range(PEERS):
        if q == RANK:  # this rank's row: row 0 of y
            total += tl.sum(tl.where(rows[:, None] == 0, y.to(tl.float32), 0.0), axis=0)
        else:
            row = received_row(here + (slots + q) * n, cols, valid, step, y.dtype)
            total += row.to(tl.float32)
    tl.store(y_ptr + cols, total.to(y_ptr.dtype.element_ty), mask=valid)


def gemv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
    send: Point | None = None,
) -> Tensor:
    """x: [M, K] (M <= 16), weight: [N, K], bias: [N] -> [M, N] (as F.linear), in
    `out_dtype` (default: x's) straight from the float32 accumulator. With `send` (one
    row, N = the exchange's width, x's dtype), the row goes to that point on every rank
    (module docstring) and the result, the group's sum, is this rank's row there. The
    programs of every rank wait for each other's: a send takes at most one program a
    multiprocessor (wider tiles where N needs them), so all of them run at once. Tiles:
    default_tiles' unless given."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes up to {MAX_ROWS} unit-stride rows of K = weight's K")
    tile_n, tile_k = default_tiles(k)
    block_n, block_k = block_n or tile_n, block_k or tile_k
    if send is not None:
        exchange = send.exchange
        if num_rows != 1 or n != exchange.width or exchange.rows.dtype != (out_dtype or x.dtype):
            raise ValueError("gemv sends one row of the exchange's width and dtype")
        y = send.local_row
        peers = (exchange.word_ptrs, exchange.step, send.index)
        block_n = max(block_n, exchange.send_block_n)
    else:
        y = torch.empty(num_rows, n, dtype=out_dtype or x.dtype, device=x.device)
        peers = (weight, weight, 0)
    grid = (triton.cdiv(n, block_n),)
    _gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        num_rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        *peers,
        HAS_BIAS=bias is not None,
        PEERS=send.exchange.size if send is not None else 0,
        RANK=send.exchange.rank if send is not None else 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


def default_tiles(k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): the fastest of a sweep on an H100 at Llama-3-8B and SmolLM2
    shapes (M = 1, 4): 32 x 512 for K >= 2048, 16 x 128 for smaller K (more programs for
    the small matrices); docs/benchmarks.md has the sweep."""
    return (32, 512) if k >= 2048 else (16, 128)
