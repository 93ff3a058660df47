"""4-bit weights, 16-bit activations: y = x @ W^T (+ b) with W stored as 4-bit integers.

    W[n, k] = (q[n, k] - z[k // G, n]) * s[k // G, n]     q, z in 0..15; G = group_size

The layout (W4A16Weight in quant/w4a16.py holds it), K in blocks of 128:

    qweight: [K / 8, N] int32   word (16 b + r, n) holds q[n, 128 b + 16 j + r] in bits
                                4 j .. 4 j + 3 (r < 16, j < 8)
    scales:  [K / G, N]         the activations' dtype
    zeros:   [K / G, N] uint8

so that nibble j of a block's 16 words [16, BLOCK_N] is the weight slice of the 16
consecutive inputs 128 b + 16 j ...: the unpacking is elementwise (a shift and a mask,
no shuffle between threads), each slice meets a contiguous [BLOCK_M, 16] slice of x in
its own tl.dot, and the loads feed the dots the way Triton pipelines. (Packed along K in
plain order, k = 8 r + j as GPTQ does, the 8 nibbles of a word would have to be
interleaved back into K order, a shuffle through shared memory per tile: 4x slower.)

On CUDA, 1 to 32 rows in bf16 or fp16 with groups of 128 go to lmd._native's CUDA kernels
instead (kernels/w4a16_rows.py: mma.sync on this layout; the batch-1 decode step of an
8B model 3.45 -> 2.32 ms on an H200, docs/benchmarks.md); the tiles below take the rest.

A program owns BLOCK_M rows of x and BLOCK_N output columns and walks its share of K,
BLOCK_K (a multiple of 128) at a time. The codes become floats by their bits alone, on
CUDA two at a time in PTX (w4a16_nibbles.py); the kernels are bound by their instructions,
not by memory (the same microseconds on an H200 as on an H100). Then:

- decode (tiles of up to 32 rows; one 16-row tile for M <= 16): tl.dot(x, q - z) is
  exact in float32, and is scaled once per group, `acc += dot * s`. When one program
  per BLOCK_N columns leaves the GPU short of programs, K is split over SPLIT_K
  programs that write float32 partial sums, and a second launch adds them in a fixed
  order (deterministic) with the bias. (The tile's last split adding them, found by an
  arrival counter, saved the launch but was slower with the packed nibbles: down at
  M = 1 31.3 against 25.7 us; docs/benchmarks.md.)
- 17 to 127 rows (64-row tiles, `swap_ab`: y^T = W x^T, the weights tl.dot's first
  operand, 1.05-1.2x faster than unswapped): (q - z) * s rounded once to the
  activations' dtype, a block's 8 nibbles stacked into its 128 inputs in order
  (block_weights) and one tl.dot a block (a dot per 16 inputs was 4-7% slower);
  programs walk M fastest, so the row tiles that share a weight tile run back to back
  and the tile is read from memory about once. Bound neither by memory nor by the
  instruction count: each block's weights wait on a trip through shared memory into
  the wgmma operand's layout (docs/benchmarks.md, "W4A16 at 64 rows").
- from DENSE_ROWS rows, neither: a slab of W at a time is dequantized to x's dtype
  (at most w4a16_dense.SLAB_BYTES) and cuBLAS multiplies. Past a few hundred rows the product is
  bound by the tensor cores, and these tiles, which dequantize every weight once per
  row tile and do not overlap that with the dots, ran at a third of cuBLAS.

Nothing synchronizes with the host and every buffer comes from torch's allocator, so
a decode step is captured in a CUDA graph as any other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.w4a16_dense import PACK_K, dense_matmul
from lmd.engine.turbo.kernels.w4a16_nibbles import biased, block_weights, block_words, nibbles
from lmd.engine.turbo.kernels.w4a16_rows import native_rows

SKINNY_ROWS = 16  # up to this many rows of x: the decode tiling
DENSE_ROWS = 128  # from this many rows: dequantize slabs of W and let cuBLAS multiply


class Tiles(NamedTuple):
    """A tiling: rows, columns and K (a multiple of 128) of one program's tile, K splits
    (0: as many as fill the GPU twice over), warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False  # y^T = W x^T: the weights as tl.dot's first operand


@triton.jit
def _dot(x, w, acc, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x @ w, or with SWAP_AB its transpose acc + w^T @ x^T."""
    if SWAP_AB:
        return tl.dot(tl.trans(w), tl.trans(x), acc, input_precision=PRECISION)
    else:
        return tl.dot(x, w, acc, input_precision=PRECISION)


@triton.jit
def _per_col(v, SWAP_AB: tl.constexpr):
    """A [BLOCK_N] vector against the accumulator: a row, or a column when swapped."""
    if SWAP_AB:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def scaled_after_dots(  # noqa: PLR0917  # Triton functions take positional arguments
    x_at,
    x_mask,
    words,
    s_ptr,
    z_ptr,
    kb,
    n,
    cols,
    col_ok,
    acc,
    GROUP: tl.constexpr,
    DTYPE: tl.constexpr,
    PACKED: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc + x @ W^T over the 128 inputs kb ... of one block of words [16, BLOCK_N], the
    decode form: a tl.dot per nibble j of (q - z) with x's 16 inputs kb + 16 j ...
    (x_at + kb + 16 j: [BLOCK_M, 16] pointers, x_mask their rows), exact in float32, and
    each group's sum scaled once (scales and zero points at s_ptr, z_ptr: [K / G, n])."""
    part = tl.zeros_like(acc)
    for j in tl.static_range(8):
        if (16 * j) % GROUP == 0:  # a group starts: its scales and zero points
            group = ((kb + 16 * j) // GROUP) * n
            s = tl.load(s_ptr + group + cols, mask=col_ok, other=0.0).to(DTYPE)
            z = biased(tl.load(z_ptr + group + cols, mask=col_ok, other=0).to(tl.int32), DTYPE)
        w = nibbles(words, j, DTYPE, PACKED) - z[None, :]  # [16, BLOCK_N]
        x = tl.load(x_at + kb + 16 * j, mask=x_mask, other=0.0)  # [BLOCK_M, 16]
        part = _dot(x, w, part, SWAP_AB, PRECISION)
        if j == 7 or (16 * (j + 1)) % GROUP == 0:  # the group's (or block's) end
            acc += part * _per_col(s.to(tl.float32), SWAP_AB)
            part = tl.zeros_like(part)
    return acc


@triton.jit
def four_bit_slice(  # noqa: PLR0917  # Triton functions take positional arguments
    acc,
    a_rows,
    real,
    w_base,
    stride_wn,
    ws_at,
    zs_at,
    k0,
    n,
    cols,
    valid,
    GROUP: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    DTYPE: tl.constexpr,
    PACKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc + a @ W^T over the 128 inputs from k0 of 4-bit experts (the expert's words at
    w_base, rows stride_wn apart; its scales and zero points at ws_at, zs_at): a dot per
    nibble's 16 inputs and each group scaled once (SCALE_AFTER, this kernel's decode
    form), or the words made [128, BLOCK_N] weights and one dot (kernels/moe.py's grouped
    GEMM's slice of 4-bit experts)."""
    words = block_words(w_base, k0, stride_wn, cols, valid)
    if SCALE_AFTER:
        return scaled_after_dots(a_rows + tl.arange(0, 16)[None, :], real[:, None], words, ws_at,
                                 zs_at, k0, n, cols, valid, acc, GROUP, DTYPE, PACKED, False,
                                 PRECISION)  # fmt: skip
    w = block_weights(words, ws_at, zs_at, k0, n, cols, valid, GROUP, DTYPE, PACKED)
    a = tl.load(a_rows + k0 + tl.arange(0, 128)[None, :], mask=real[:, None], other=0.0)
    return tl.dot(a, w, acc, input_precision=PRECISION)


@triton.jit
def _w4a16_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    m,
    n,
    k,
    k_per_split,
    stride_x,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PACKED: tl.constexpr,
    SCALE_AFTER_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    num_m = tl.cdiv(m, BLOCK_M)
    rows = (tl.program_id(0) % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tl.program_id(0) // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    split = tl.program_id(1)
    k_start = split * k_per_split
    k_end = tl.minimum(k, k_start + k_per_split)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x + tl.arange(0, 16)[None, :]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        for b in tl.static_range(BLOCK_K // 128):
            kb = k0 + 128 * b
            words = block_words(q_ptr, kb, n, cols, col_ok)  # [16, BLOCK_N] int32
            if SCALE_AFTER_DOT:  # decode: a tl.dot per 16 inputs, scaled once a group
                acc = scaled_after_dots(x_rows, row_ok[:, None], words, s_ptr, z_ptr, kb, n,
                                        cols, col_ok, acc, GROUP, dtype, PACKED, SWAP_AB,
                                        PRECISION)  # fmt: skip
            else:  # one tl.dot for the block's 128 inputs
                x = tl.load(
                    x_ptr
                    + rows[:, None].to(tl.int64) * stride_x
                    + (kb + tl.arange(0, 128))[None, :],
                    mask=row_ok[:, None],
                    other=0.0,
                )  # [BLOCK_M, 128]
                w = block_weights(words, s_ptr, z_ptr, kb, n, cols, col_ok, GROUP, dtype, PACKED)
                acc = _dot(x, w, acc, SWAP_AB, PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + split.to(tl.int64) * m * n  # split > 0 only for float32 partial sums
    tl.store(
        out + rows[:, None].to(tl.int64) * n + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _sum_splits_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    p_ptr,
    b_ptr,
    y_ptr,
    size,
    n,
    num_splits,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y = sum over splits of p[split] (+ b), in split order. p: [S, M, N] float32."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(num_splits):
        acc += tl.load(p_ptr + split * size + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


PACKED_NIBBLES = True  # on CUDA in 16 bits, nibbles to floats two at a time (w4a16_nibbles)
WIDE_N = 16384  # decode tiles 128 columns wide from this many output columns


def default_tiles(m: int, n: int) -> Tiles:
    """The tiling for m rows of x and n output columns: the fastest of scripts/
    w4a16_tiles.py on an H100 at Llama-3-8B's shapes in bf16 (docstring of w4a16_matmul).
    Decode: 16 x 64 tiles, 16 x 128 from WIDE_N columns (gate|up: 36.8 against 39.9 us
    on an H200 with the packed nibbles; qkv, o and down are 1.2-1.4x slower so), K split
    up to 4 ways; up to 127 rows: 32- or 64-row tiles x 128 columns (64 and 256 columns
    were slower), the 64-row ones swapped (H200, one tl.dot a block of K: gate|up 71.7
    against 84.8 us, the others 2-5% faster). From DENSE_ROWS rows the
    launcher goes to cuBLAS instead; this 128 x 128 tiling (operands swapped, the best
    of the fused ones there) is for `dense_rows` set higher."""
    if m <= SKINNY_ROWS:
        return Tiles(16, 128 if n >= WIDE_N else 64, 128, 0, 4, 3)
    if m <= 32:
        return Tiles(32, 128, 128, 0, 4, 3)
    if m < DENSE_ROWS:
        return Tiles(64, 128, 128, 0, 4, 3, swap_ab=True)
    return Tiles(128, 128, 128, 1, 8, 3, swap_ab=True)


def _splits(tiles: Tiles, m: int, n: int, k: int, *, block_k: int, num_sms: int) -> int:
    """tiles.split_k, or for 0 as many splits of K (each at least one BLOCK_K) as bring
    the programs to 8x the multiprocessors for decode tiles (a power of two, at most
    4), 2x for larger ones (at most 16)."""
    if tiles.split_k:
        return tiles.split_k
    programs = int(triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n))
    if tiles.block_m <= SKINNY_ROWS:
        wanted = int(triton.next_power_of_2(triton.cdiv(8 * num_sms, programs)))
        return max(1, min(wanted, 4, k // block_k))
    return max(1, min(2 * num_sms // programs, k // block_k, 16))


def w4a16_matmul(  # noqa: PLR0917  # the weight's tensors, as W4A16Weight holds them
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    group_size: int,
    bias: Tensor | None = None,
    *,
    tiles: Tiles | None = None,
    dense_rows: int = DENSE_ROWS,
) -> Tensor:
    """x: [M, K] (float16, bfloat16; float32 for the interpreter's tests), qweight:
    [K / 8, N] int32, scales: [K / G, N], zeros: [K / G, N] uint8, bias: [N] -> [M, N]
    in x's dtype (layout in the module's docstring).

    K is a multiple of 128 and of G, G of 16. `tiles` overrides default_tiles (and the
    cuBLAS route); scripts/w4a16_tiles.py sweeps them. Measured on an H100 in bf16 at
    Llama-3-8B's (N, K) = qkv (6144, 4096), o (4096, 4096), gate|up (28672, 4096), down
    (4096, 14336), weights read from memory: M = 1 takes 14, 11, 43, 27 us (1.1-1.45
    TB/s of packed weights; 16-bit cuBLAS 22, 17, 103, 47), so the 32 layers' linears
    of a decode step take 3.0 ms (6.0 in 16 bits); M = 64: 26, 19, 88, 46 us (cuBLAS 22,
    16, 93, 50); M = 512 (cuBLAS route): 0.45-0.67x of cuBLAS on 16-bit weights. With
    the packed nibbles and gate|up's 128-wide tiles (H200): M = 1 12.9, 10.9, 37.6, 26.3
    us, the linears 2.8 ms a step."""
    m, k = x.shape
    n = qweight.shape[1]
    groups = k // group_size if group_size > 0 else 0
    if (
        group_size <= 0
        or qweight.shape[0] * 8 != k
        or k % PACK_K
        or group_size % 16
        or k % group_size
        or scales.shape != (groups, n)
        or zeros.shape != (groups, n)
        or x.stride(1) != 1
    ):
        raise ValueError(
            f"w4a16_matmul: x {tuple(x.shape)} against qweight {tuple(qweight.shape)}, "
            f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}, group {group_size}"
        )
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    if tiles is None and m >= dense_rows:
        return dense_matmul(x, qweight, scales, zeros, group_size, bias, y)
    if tiles is None and native_rows(x, qweight, scales, zeros, group_size, bias, y):
        return y
    tiles = tiles or default_tiles(m, n)
    block_k = tiles.block_k
    if block_k % PACK_K:
        raise ValueError(f"w4a16_matmul: BLOCK_K {block_k} is not a multiple of {PACK_K}")
    splits = _splits(tiles, m, n, k, block_k=block_k, num_sms=num_sms)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty splits
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n), split)
    _w4a16_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        GROUP=group_size,
        HAS_BIAS=bias is not None and split == 1,
        PACKED=PACKED_NIBBLES and x.is_cuda and x.dtype != torch.float32,
        SCALE_AFTER_DOT=tiles.block_m <= 32,
        SWAP_AB=tiles.swap_ab,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32: no TF32 rounding
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            out,
            bias if bias is not None else scales,
            y,
            m * n,
            n,
            split,
            HAS_BIAS=bias is not None,
            BLOCK=block,
        )
    return y
