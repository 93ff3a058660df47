"""The W4A16 product of a decode step's rows through lmd._native's CUDA kernels: 1-16 rows
by native/kernels/w4a16_rows.cu, 17-32 by native/kernels/w4a16_wide.cu, 33-64 on Hopper
by native/kernels/w4a16_wgmma.cu; 4-bit experts' blocks of 8 or 16 sorted pairs
(kernels/moe.py's grouped GEMM at decode) by native/kernels/w4a16_experts.cu, the rows
kernel's CTA for a block's pairs and expert, and on Hopper blocks of 64 by the wgmma
kernel's experts entry (its CTA for a block's pairs and expert). The first two run
mma.sync on the tensor cores with the codes made into 16-bit operands two at a time in
registers, 16-byte loads of the packed weights, the next block of K loaded while the
current one is multiplied; the wide one shares x among a CTA's 128 columns through
shared memory and splits K over CTAs, summed in split order by the last CTA of a span.
The wgmma one makes the same operands in the registers of four warpgroups that run wgmma
on them while a fifth copies the words and x into shared memory (its file says how), and
splits K over CTAs all resident at once, a span's CTAs each adding a share of their sums
once all have stored theirs. (kernels/w4a16_normed.py launches the rows kernel's normed
entries.)

They read the layout that kernels/w4a16.py's Triton tiles read (quant/w4a16.py), so
they need no copy of the weights; they take 1-32 rows (1-64 on Hopper) of bf16 or fp16,
groups of 128 inputs and a multiple of 32 output columns, and `native_rows` says False
for anything else (the caller then runs the Triton tiles). The launch goes on PyTorch's
current stream, so a decode step's CUDA graph captures it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmd._native import (
    w4a16_experts,
    w4a16_rows,
    w4a16_rows_ready,
    w4a16_wgmma,
    w4a16_wgmma_ctas,
    w4a16_wgmma_ready,
    w4a16_wide,
)
from lmd.engine.turbo.kernels.native_kernels import NativeKernels, device_index

NATIVE_ROWS = True  # off: decode rows go to the Triton tiles (scripts' A/B runs)
ROWS_GATED = True  # off: 1-16 rows' gate|up products leave SiLU to a launch of its own
MAX_ROWS = 16  # the rows kernel's; the wide kernel's is WIDE_MAX_ROWS
WIDE_MAX_ROWS = 32  # from 33 rows the Triton tiles were as fast (docs/benchmarks.md)
EXPERTS = True  # off: 4-bit experts' small blocks go to the Triton grouped GEMM (A/B runs)
EXPERTS_ROWS = (8, 16)  # the experts kernel's blocks of pairs
WGMMA_EXPERTS = True  # off: 4-bit experts' 64-row blocks are not native (A/B runs)
WGMMA_EXPERTS_ROWS = 64  # a block of pairs of the wgmma kernel's experts entry (Hopper)
NATIVE_EXPERTS_ROWS = (*EXPERTS_ROWS, WGMMA_EXPERTS_ROWS)
MAX_BLOCKS = 65535  # blocks of pairs a launch (the grid's second dimension)
# A CTA's warps by the pairs of the product (at most K / 128): 4 up to 16 pairs, 2 up to
# 128, else 1. On an H200 at Qwen3-30B-A3B's experts (scripts/moe_tiles.py
# --expert-warps, gate|up + down, us at 1 / 2 / 4 warps): 1 token 18.7 / 15.7 / 14.4; 8
# tokens 56.5 / 53.9 / 57.5; 64 tokens 186.4 / 200.0 / 235.7; 256 tokens 286.7 / 311.3
# / 388.3. EXPERT_WARPS None: that rule; else this.
EXPERT_WARPS: int | None = None
EXPERT_WARPS_BY_PAIRS = ((16, 4), (128, 2))  # (at most this many pairs, warps)
# One token's mix (native_experts' `mixed`): a CTA's warps, shared by its pairs two a
# warp, and the most pairs.
MIXED_WARPS = 16
MIXED_MAX_PAIRS = 16
WGMMA = True  # off: 33-64 rows go to the Triton tiles on Hopper too (scripts' A/B runs)
WGMMA_MAX_ROWS = 64
WGMMA_SPAN = 256  # output columns of a wgmma kernel's CTA
WGMMA_MAX_SPLITS = 8  # a CTA adds a share of each of its span's splits' sums
GROUP = 128
COLUMNS = 32  # output columns of a rows kernel's CTA
SPAN = 128  # output columns of a wide kernel's CTA
MAX_SPANS = 4096  # a wide product's spans, so N <= 524,288 (each has a counter)
WARPS_PER_SM = 16  # what the kernels' registers leave room for at up to 8 rows (8 above)
WIDE_CTAS_PER_SM = 2  # what default_splits plans for (3 fit; 2 measured best at 64 rows)

Packed = tuple[Tensor, Tensor, Tensor, int]  # a W4A16Weight's qweight, scales, zeros, group

_kernels = NativeKernels(w4a16_rows_ready, "W4A16 decode rows go to the Triton tiles")
_wgmma = NativeKernels(w4a16_wgmma_ready, "W4A16 decode steps of 33-64 rows take the Triton tiles")
# A device's span counters for the split kernels: the wide one's 32 bits a span, zero
# between launches; the wgmma one's 64 bits a span, a multiple of 840 between launches
# (each adds 840; never reset). Their launches must not overlap in time (one stream; lmd
# runs one forward at a time a process).
_counters: dict[int, Tensor] = {}
_wgmma_counters: dict[int, Tensor] = {}
_wgmma_ctas: dict[int, int] = {}  # a device's w4a16_wgmma_ctas


def ready(device: torch.device) -> bool:
    """Are the kernels loaded on this CUDA device? Loads them on the first call (the
    driver compiles the PTX, and the split kernels' counters are allocated: call it
    before a CUDA graph is captured); logs once why not."""
    index = device_index(device)
    if not _kernels.ready(index):
        return False
    if index not in _counters:
        _counters[index] = torch.zeros(MAX_SPANS, dtype=torch.int32, device=device)
        wgmma_spans = MAX_SPANS * SPAN // WGMMA_SPAN
        _wgmma_counters[index] = torch.zeros(wgmma_spans, dtype=torch.int64, device=device)
    return True


def default_warps(m: int, n: int, k: int, num_sms: int) -> int:
    """Warps a CTA, each taking every warps-th block of K: the most (a power of two) that
    keep all N / 32 CTAs resident in one wave, but at least 4. Measured at M = 1 on an
    H200 (scripts/w4a16_switches.py --warps, us; one wave fits up to): qkv 8 warps 8.4, 4
    9.2, 16 9.1 (8); o 16 5.6, 8 6.2 (16); gate|up 4 23.4, 2 24.9, 8 24.6 (2); down 16
    13.4, 8 15.2 (16). CTAs of 2-4 spans of 32 columns side by side were no faster."""
    budget = WARPS_PER_SM if m <= 8 else WARPS_PER_SM // 2
    fits = max(1, budget * num_sms // (n // COLUMNS))
    warps = max(4, 1 << (fits.bit_length() - 1))  # the power of two at or under, or 4
    return max(1, min(warps, budget, k // GROUP))


def default_splits(n: int, k: int, num_sms: int) -> int:
    """Ranges of K for the wide kernel: as many as give every multiprocessor its two CTAs
    (rounded down), at most one a block of K."""
    spans = -(-n // SPAN)
    return max(1, min(k // GROUP, WIDE_CTAS_PER_SM * num_sms // spans))


def wgmma_splits(n: int, k: int, ctas: int) -> int:
    """Ranges of K for the wgmma kernel (one CTA a multiprocessor: its stages fill shared
    memory): the most, at most one a block of K and WGMMA_MAX_SPLITS, whose CTAs of all
    spans the device runs at once (`ctas`: lmd._native.w4a16_wgmma_ctas), as a launch of
    more than one split must; else 1. On an H200 (132): qkv 5, o and down 8, gate|up 1."""
    spans = -(-n // WGMMA_SPAN)
    fits = [s for s in range(1, min(WGMMA_MAX_SPLITS, k // GROUP) + 1) if spans * s <= ctas]
    return max(fits, default=1)


def num_sms(device: int) -> int:
    """The multiprocessors of a device where the kernels are loaded (ready)."""
    return _kernels.num_sms(device)


def wgmma_ctas(device: int) -> int:
    """lmd._native.w4a16_wgmma_ctas of a device (which loads the wgmma kernel there if it
    is not yet), asked once."""
    if device not in _wgmma_ctas:
        _wgmma_ctas[device] = w4a16_wgmma_ctas(device)
    return _wgmma_ctas[device]


def native_rows(  # noqa: PLR0917  # the weight's tensors, as W4A16Weight holds them
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    group_size: int,
    bias: Tensor | None,
    y: Tensor,
    *,
    warps: int | None = None,
    splits: int | None = None,
    gated: bool = False,
) -> bool:
    """y [M, N] (contiguous) = x W^T (+ b) through a native kernel when one takes the
    product and is loaded on x's device; False (y untouched) otherwise. Shapes as
    w4a16_matmul's; `warps` (a rows kernel's CTA) overrides default_warps, `splits` (the
    wide kernel's) default_splits (scripts/w4a16_switches.py). Besides the shapes, their
    loads need x's rows 8-byte aligned (16 from 17 rows on, and y and the bias 8), the
    weight's tensors contiguous and aligned. `gated`: W is gate | up and y [M, N / 2] =
    silu(x gate^T) * (x up^T), taken by the rows kernel (1-16 rows) and the wgmma kernel
    (33-64) in one split, with no bias."""
    m, k = x.shape
    n = qweight.shape[1]
    wide = m > MAX_ROWS
    if not rows_take(x, (qweight, scales, zeros, group_size), bias, y, gated):
        return False
    device = device_index(x.device)
    wgmma = m > WIDE_MAX_ROWS
    if wgmma and not (
        _wgmma.ready(device) and scales.data_ptr() % 16 == 0 and zeros.data_ptr() % 16 == 0
    ):  # the wgmma kernel copies scales and zeros 16 bytes at a time
        return False
    stream = torch.cuda.current_stream(x.device).cuda_stream
    num_sms = _kernels.num_sms(device)
    bf16 = x.dtype == torch.bfloat16
    b = 0 if bias is None else bias.data_ptr()
    addresses = (
        x.data_ptr(),
        qweight.data_ptr(),
        scales.data_ptr(),
        zeros.data_ptr(),
        b,
        y.data_ptr(),
    )
    if not wide:
        warps = default_warps(m, n, k, num_sms) if warps is None else warps
        w4a16_rows(device, *addresses, m, n, k, x.stride(0), bf16, warps, stream, gated)
        return True
    if splits is None:
        splits = wgmma_splits(n, k, wgmma_ctas(device)) if wgmma else default_splits(n, k, num_sms)
    if gated and splits > 1:  # its sums are added across CTAs, past the activation
        return False
    work = counters = 0
    if wgmma:
        if splits > 1:  # each CTA's float32 sums, added by its span's CTAs, a share each
            spans = -(-n // WGMMA_SPAN)
            shape = (spans * splits, WGMMA_MAX_ROWS, WGMMA_SPAN)
            buffer = torch.empty(shape, dtype=torch.float32, device=x.device)
            work, counters = buffer.data_ptr(), _wgmma_counters[device].data_ptr()
        w4a16_wgmma(
            device, *addresses, work, counters, m, n, k, x.stride(0), splits, bf16, stream, gated
        )
        return True
    if splits > 1:  # the splits' float32 sums, added by the last CTA of each span
        buffer = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        work, counters = buffer.data_ptr(), _counters[device].data_ptr()
    w4a16_wide(device, *addresses, work, counters, m, n, k, x.stride(0), splits, bf16, stream)
    return True


def rows_take(x: Tensor, weight: Packed, bias: Tensor | None, y: Tensor, gated: bool) -> bool:
    """Whether native_rows' shapes, dtypes and alignments let a kernel take the product
    of x and weight (qweight, scales, zeros, group size), the kernels loaded on x's device
    (the wgmma kernel's own needs apart; the normed launches' too, kernels/w4a16_normed.py)."""
    qweight, scales, zeros, group_size = weight
    m, k = x.shape
    n = qweight.shape[1]
    wide = m > MAX_ROWS
    if gated and not (
        (ROWS_GATED or m > MAX_ROWS)
        and not MAX_ROWS < m <= WIDE_MAX_ROWS
        and bias is None
        and n % 64 == 0
    ):
        return False
    takes = (
        NATIVE_ROWS
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and scales.dtype == x.dtype
        and group_size == GROUP
        and 1 <= m <= (WGMMA_MAX_ROWS if WGMMA else WIDE_MAX_ROWS)
        and n % COLUMNS == 0
        and -(-n // SPAN) <= MAX_SPANS
        and k % GROUP == 0
        and x.stride(1) == 1
        and x.stride(0) % (8 if wide else 4) == 0
        and x.data_ptr() % (16 if wide else 8) == 0
        and y.is_contiguous()
        and y.data_ptr() % (8 if wide else 2) == 0
        and all(
            t.is_contiguous() and t.data_ptr() % align == 0
            for t, align in ((qweight, 16), (scales, 8), (zeros, 4))
        )
        and (
            bias is None
            or (
                bias.is_contiguous()
                and bias.dtype == x.dtype
                and bias.data_ptr() % (8 if wide else 2) == 0
            )
        )
    )
    return takes and ready(x.device)


def experts_blocks(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int) -> tuple[int, ...]:
    """The blocks of pairs (rows) in which native_experts takes x (its dtype, device where
    the kernels load, strides and alignment) against 4-bit experts of these words, scales
    and groups, whatever the blocks' layout: EXPERTS_ROWS, and WGMMA_EXPERTS_ROWS too on
    Hopper; () for none."""
    takes = (
        EXPERTS
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and x.stride(0) % 4 == 0
        and x.data_ptr() % 8 == 0
        and scales.dtype == x.dtype
        and group_size == GROUP
        and qweight.shape[2] % COLUMNS == 0
        and qweight.shape[1] * 8 % GROUP == 0
        and ready(x.device)
    )
    if not takes:
        return ()
    # The wgmma kernel copies x, the scales and the zeros 16 bytes at a time.
    wgmma = (
        WGMMA_EXPERTS
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and scales.data_ptr() % 16 == 0
        and _wgmma.ready(device_index(x.device))
    )
    return NATIVE_EXPERTS_ROWS if wgmma else EXPERTS_ROWS


def native_experts(  # noqa: PLR0917  # the experts' tensors, as W4A16Experts holds them
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    group_size: int,
    sorted_pairs: Tensor | None,
    block_expert: Tensor,
    y: Tensor,
    *,
    row_div: int,
    block_m: int,
    weights: Tensor | None = None,
    warps: int | None = None,
    gated: bool = False,
    mixed: bool = False,
) -> bool:
    """y[p] = x[p // row_div] @ W_e^T (* weights[p]) for every pair p of the blocks of
    block_m (8 or 16; 64 on Hopper, the wgmma kernel's) sorted pairs
    (kernels/moe_align.py's layout; y [P, N] contiguous, P its rows; no sorted pairs, 8
    rows: block p holds pair p alone), W_e the block's expert's: qweight [E, K / 8, N],
    scales and zeros [E, K / 128, N]; True once enqueued, False (y untouched) when the
    kernel does not take it. `warps` overrides EXPERT_WARPS. `gated`: W_e is gate | up
    and y [P, N / 2] = silu(x gate^T) * (x up^T) (N a multiple of 64, no weights).
    `mixed`: one token's pairs (no sorted pairs, 8 rows, weights given, at most
    MIXED_MAX_PAIRS), y [1, N] = the sum over p of weights[p] * x[p // row_div] @ W_e^T,
    each term rounded to x's dtype first; `warps` then a two pairs' (default MIXED_WARPS
    shared by the pairs)."""
    k, n = x.shape[1], qweight.shape[2]
    wgmma = block_m == WGMMA_EXPERTS_ROWS
    num_pairs = block_expert.numel() if mixed else y.shape[0]
    if wgmma:
        warps = 0  # the wgmma kernel's own CTAs
    elif mixed:
        warps = max(1, MIXED_WARPS // ((num_pairs + 1) // 2)) if warps is None else warps
    elif warps is None:
        by_pairs = (w for most, w in EXPERT_WARPS_BY_PAIRS if y.shape[0] <= most)
        warps = EXPERT_WARPS if EXPERT_WARPS is not None else next(by_pairs, 1)
    warps = min(warps, k // GROUP)
    takes = (
        block_m in experts_blocks(x, qweight, scales, group_size)
        and (not wgmma or sorted_pairs is not None)
        and (not gated or (n % 64 == 0 and weights is None and not mixed))
        and (
            not mixed
            or (
                block_m == 8
                and sorted_pairs is None
                and weights is not None
                and num_pairs <= MIXED_MAX_PAIRS
                and y.shape[0] == 1
            )
        )
        and k == qweight.shape[1] * 8
        and block_expert.numel() <= MAX_BLOCKS
        and y.is_contiguous()
        and y.dtype == x.dtype
        and y.shape[1] == (n // 2 if gated else n)
        and block_expert.dtype == torch.int32
        and block_expert.is_contiguous()
        and (
            block_expert.numel() == num_pairs
            if sorted_pairs is None
            else sorted_pairs.dtype == torch.int32
            and sorted_pairs.is_contiguous()
            and sorted_pairs.numel() == block_expert.numel() * block_m
        )
        and (weights is None or (weights.dtype == torch.float32 and weights.is_contiguous()))
        and all(
            t.is_contiguous() and t.data_ptr() % align == 0
            for t, align in (
                (qweight, 16),
                (scales, 16 if wgmma else 8),
                (zeros, 16 if wgmma else 4),
            )
        )
    )
    if not takes:
        return False
    device = device_index(x.device)
    w4a16_experts(
        device,
        x.data_ptr(),
        qweight.data_ptr(),
        scales.data_ptr(),
        zeros.data_ptr(),
        0 if sorted_pairs is None else sorted_pairs.data_ptr(),
        block_expert.data_ptr(),
        0 if weights is None else weights.data_ptr(),
        y.data_ptr(),
        block_m,
        1 if mixed else block_expert.numel(),
        num_pairs,
        row_div,
        n,
        k,
        x.stride(0),
        x.dtype == torch.bfloat16,
        warps,
        torch.cuda.current_stream(x.device).cuda_stream,
        gated,
        mixed,
    )
    return True
