"""A layer of experts (Mixtral, Qwen3-MoE): route each token to k experts, run them, mix.

    probs = softmax(h @ Wrouter^T)                   # [T, E] float32
    weights, experts = top-k of probs                # [T, k], renormalized if asked
    for each (token t, choice j): y[t] += weights[t, j] * mlp_{experts[t, j]}(h[t])

The T * k (token, choice) pairs are numbered `t * k + j`. `align` sorts them by expert
and pads each expert's run to a multiple of BLOCK_M, so that every block of BLOCK_M
sorted pairs belongs to one expert; the grouped GEMM then runs all experts in one
launch, a program per (block, BLOCK_N output columns), each reading its expert's weight
tile once for all the block's rows. Gate/up and down are two such launches with the
SiLU-and-multiply between (or made in the first, `GATED_GEMM`); the down launch scales
each row by its routing weight and the k rows of a token are summed.

Everything runs on the device without a host sync (the padded layout is sized for the
worst case), so a decode step with experts is captured in a CUDA graph as any other. A
layer of experts is 9 launches (8 with GATED_GEMM): the router's GEMM, softmax + top-k,
the layout (the counts' zeroing and two kernels), two grouped GEMMs, SiLU, the sum over k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.activation import gate_up_rows, gated, silu_and_mul
from lmd.engine.turbo.kernels.common import expert_scales
from lmd.engine.turbo.kernels.routing import route
from lmd.engine.turbo.quant.fp8_experts import Fp8Experts, kernel_operands


@triton.jit
def _grouped_gemm_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    a_ptr,
    w_ptr,
    c_ptr,
    scale_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    n,
    k,
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    ws_ptr,  # FP8: the codes' scales and where they are (fp8_experts.kernel_operands)
    stride_se,
    stride_sn,
    stride_sk,
    scale_rows,
    scale_cols,
    A_ROW_DIV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP8: tl.constexpr,  # w is e4m3 codes: widened to a's dtype, each slice's product scaled
    SCALE_ONCE: tl.constexpr,  # FP8 with one scale a row (K one block): the sum scaled
    GATED: tl.constexpr,  # w is gate | up [E, 2I, K]: write silu(gate) * up, [P, I]
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:  # past the last expert's run: nothing to do
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)  # (token, choice) pair ids; num_pairs = padding
    real = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)  # gate/up reads token t = pair // k
    if GATED:  # columns gate_0, up_0, gate_1, up_1, ... of BLOCK_N / 2 outputs
        cols, valid = gate_up_rows(tl.program_id(1), n, BLOCK_N)
    else:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = cols < n
    w_base = w_ptr + expert * stride_we
    ws_at = ws_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_row[:, None] * stride_a + ks[None, :],
            mask=real[:, None] & (ks[None, :] < k),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
            mask=valid[None, :] & (ks[:, None] < k),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if FP8 and not SCALE_ONCE:  # each block of K its own scale
            ws = expert_scales(ws_at, cols, k0, stride_sn, stride_sk, scale_rows, scale_cols, valid)
            acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * ws[None, :]
        else:
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    if FP8 and SCALE_ONCE:  # a scale a row: the whole sum scaled once
        acc *= expert_scales(ws_at, cols, 0, stride_sn, 0, scale_rows, 1, valid)[None, :]
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + pair, mask=real, other=0.0).to(tl.float32)[:, None]
    dtype: tl.constexpr = c_ptr.dtype.element_ty
    c_rows = c_ptr + pair.to(tl.int64)[:, None] * stride_c
    if GATED:  # each product rounded first, as silu_and_mul reads it
        gate, up = tl.split(tl.reshape(acc.to(dtype), (BLOCK_M, BLOCK_N // 2, 2)))
        half = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        act = gated(gate, up, False).to(dtype)
        tl.store(c_rows + half[None, :], act, mask=real[:, None] & (half[None, :] < n // 2))
    else:
        tl.store(c_rows + cols[None, :], acc.to(dtype), mask=real[:, None] & valid[None, :])


@triton.jit
def _count_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    experts_ptr,
    counts_ptr,
    ranks_ptr,
    ends_ptr,
    num_pairs,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """align's first launch: each pair's rank among its expert's pairs (atomic adds on
    counts_ptr: E counts and a count of finished programs after them, all 0 before);
    the last program to finish writes where each expert's run ends, the runs in expert
    order and each padded to a multiple of BLOCK_M."""
    pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = pair < num_pairs
    expert = tl.load(experts_ptr + pair, mask=real, other=0)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=real, sem="relaxed")
    tl.store(ranks_ptr + pair, rank, mask=real)
    tl.debug_barrier()  # every thread's adds returned before the program counts itself
    if tl.atomic_add(counts_ptr + num_experts, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        e = tl.arange(0, BLOCK_E)
        counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0, cache_modifier=".cg")
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(ends_ptr + e, tl.cumsum(padded, axis=0), mask=e < num_experts)


@triton.jit
def _run_start(end, count, BLOCK_M: tl.constexpr):
    """Where an expert's run starts: its end less its count padded to BLOCK_M."""
    return end - (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M


@triton.jit
def _place_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    experts_ptr,
    counts_ptr,
    ranks_ptr,
    ends_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """align's second launch: a program places BLOCK pairs at their run's start plus
    their rank, and for BLOCK_B blocks writes the block's expert (runs ending at or
    before it; -1 past the last) and the padding id into the slots past its run's
    pairs: every slot written once, by one program."""
    pid = tl.program_id(0)
    pair = pid * BLOCK + tl.arange(0, BLOCK)
    real = pair < num_pairs
    expert = tl.load(experts_ptr + pair, mask=real, other=0)
    count = tl.load(counts_ptr + expert, mask=real, other=0)
    start = _run_start(tl.load(ends_ptr + expert, mask=real, other=0), count, BLOCK_M)
    rank = tl.load(ranks_ptr + pair, mask=real, other=0)
    tl.store(sorted_ptr + start + rank, pair.to(tl.int32), mask=real)
    e = tl.arange(0, BLOCK_E)
    real_e = e < num_experts
    ends = tl.load(ends_ptr + e, mask=real_e, other=0)
    block = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    live = block < num_blocks
    before = (ends[None, :] <= (block * BLOCK_M)[:, None]) & real_e[None, :]
    owner = tl.sum(before.to(tl.int32), axis=1)
    owner = tl.where(owner < num_experts, owner, -1)
    tl.store(block_expert_ptr + block, owner, mask=live)
    o = tl.maximum(owner, 0)
    count = tl.load(counts_ptr + o, mask=live, other=0)
    run_end = tl.load(ends_ptr + o, mask=live, other=0)
    taken = _run_start(run_end, count, BLOCK_M) + count  # past its pairs
    taken = tl.where(owner >= 0, taken, 0)  # past the last run: all padding
    slot = block[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [BLOCK_B, BLOCK_M]
    pad = tl.zeros([BLOCK_B, BLOCK_M], dtype=tl.int32) + num_pairs
    tl.store(sorted_ptr + slot, pad, mask=live[:, None] & (slot >= taken[:, None]))


ALIGN_PAIRS = 256  # pairs a program of align's launches
PLACE_SLOTS = 1024  # sorted slots a program of the second pads (whole blocks)


def align(experts: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """experts: [T, k] int32 -> (sorted pairs [P] int32, expert of each block [P / block_m]).

    `sorted` lists the pair ids t * k + j by expert, each expert's run padded with the
    id T * k to a multiple of block_m; P is the worst case's length (each of the
    min(E, T k) experts that can be hit padded by block_m - 1), rounded up to a block.
    Blocks past the last run have expert -1. Within a run the pairs come in any order
    (ranks are taken by atomic adds). Two launches after the counts' zeroing, spread
    over programs of ALIGN_PAIRS pairs (one program took 248 us a layer at 65,536
    pairs, docs/benchmarks.md); no host sync.
    """
    flat = experts.flatten()  # [T k]
    num_pairs = flat.numel()
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = triton.cdiv(worst, block_m)
    length = num_blocks * block_m
    device = flat.device
    sorted_pairs = torch.empty(length, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)  # + programs done
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    block_b = max(1, PLACE_SLOTS // block_m)
    _count_kernel[(triton.cdiv(num_pairs, ALIGN_PAIRS),)](
        flat, counts, ranks, ends, num_pairs, num_experts,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK=ALIGN_PAIRS,
    )  # fmt: skip
    grid = max(triton.cdiv(num_pairs, ALIGN_PAIRS), triton.cdiv(num_blocks, block_b))
    _place_kernel[(grid,)](
        flat, counts, ranks, ends, sorted_pairs, block_expert, num_pairs, num_experts,
        num_blocks, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK=ALIGN_PAIRS, BLOCK_B=block_b,
    )  # fmt: skip
    return sorted_pairs, block_expert


def grouped_gemm(
    a: Tensor,
    weight: Tensor | Fp8Experts,
    sorted_pairs: Tensor,
    block_expert: Tensor,
    *,
    num_pairs: int,
    a_row_div: int,
    block_m: int,
    scale: Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
    gated: bool = False,
) -> Tensor:
    """out[p] = a[p // a_row_div] @ weight[expert of p]^T (* scale[p]) for every pair p.

    a: [R, K]; weight: [E, N, K]; scale: [P] float32 or None -> out [num_pairs, N] in
    a's dtype. Rows of pairs no block holds are left unwritten (there are none when
    `sorted_pairs` comes from `align`). `tiles`: (BLOCK_N, BLOCK_K, warps, stages), to
    try others than the default. `gated`: weight is gate | up (N = 2I) and out [P, I]
    is silu_and_mul of the product, made in the same launch (a program's columns are
    its outputs' gate and up rows side by side), bit for bit the two launches' values.
    Fp8Experts: each BLOCK_K slice's product with the codes is scaled by its block's (or
    row's) scale, BLOCK_K at most 128.
    """
    _, n, k = weight.shape
    fp8 = isinstance(weight, Fp8Experts)
    codes, scale_args = kernel_operands(weight, a)
    if a.shape[1] != k or a.stride(1) != 1 or codes.stride(2) != 1:
        raise ValueError(f"grouped_gemm: a {tuple(a.shape)} against weights {tuple(weight.shape)}")
    if gated and (n % 2 or scale is not None):
        raise ValueError("grouped_gemm's gated takes gate | up rows and no scale")
    out = torch.empty(num_pairs, n // 2 if gated else n, dtype=a.dtype, device=a.device)
    # The fastest at Qwen3-30B-A3B's shapes on an H200 (scripts/moe_tiles.py): 64 x 128
    # for decode's few rows per expert (~4 TB/s), 128 x 64 for 64-row blocks, 256 x 64
    # on 8 warps for a prefill's 128-row blocks (1.2x 64-row blocks at 4-8k tokens).
    if block_m >= 128:
        default = (min(256, triton.next_power_of_2(n)), 64, 8, 3)
    elif block_m >= 64:
        default = (128, 64, 4, 3)
    else:
        default = (64 if n >= 1024 else 32, 128, 4, 3)
    block_n, block_k, num_warps, num_stages = tiles or default
    if fp8 and scale_args[-1] < k:
        block_k = min(block_k, scale_args[-1])  # a slice within one block
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        codes,
        out,
        scale if scale is not None else a,
        sorted_pairs,
        block_expert,
        num_pairs,
        n,
        k,
        a.stride(0),
        codes.stride(0),
        codes.stride(1),
        out.stride(0),
        *scale_args,
        A_ROW_DIV=a_row_div,
        HAS_SCALE=scale is not None,
        FP8=fp8,
        SCALE_ONCE=fp8 and scale_args[-1] >= k,
        GATED=gated,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # float32: no TF32 rounding
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def block_rows(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M for this many pairs: the rows an expert gets on average, at least 16
    (tl.dot's least) and at most 128; a decode step's few rows per expert waste less
    padding with small blocks, a prefill's many use the tensor cores better with big."""
    per_expert = num_pairs / num_experts
    if per_expert <= 48:
        return 16 if per_expert <= 16 else 32
    return 64 if per_expert <= 128 else 128


# SiLU-and-multiply made in gate|up's grouped GEMM (`gated`), one launch and a [T k, 2I]
# round trip through memory fewer a layer (a 16 x 512-token prefill step of the
# Qwen3-30B-A3B shape: kernels 118.3 -> 113.9 ms on an H200). Off: the SiLU in its own
# launch (scripts/prefill_profile.py --separate-moe-activation times it so).
GATED_GEMM = True


def fused_moe(
    h: Tensor,
    router: Tensor,
    gate_up: Tensor | Fp8Experts,
    down: Tensor | Fp8Experts,
    *,
    top_k: int,
    normalize: bool,
    float_out: bool = False,
) -> Tensor:
    """h: [T, hidden]; router: [E, hidden]; gate_up: [E, 2 I, hidden]; down:
    [E, hidden, I] (16-bit as h, or FP8) -> [T, hidden] in h's dtype. `float_out`:
    torch.mm can take the router's product straight to float32 (route)."""
    num_tokens, hidden = h.shape
    num_experts = router.shape[0]
    if num_tokens == 0:
        return torch.empty_like(h)
    weights, experts = route(h, router, top_k, normalize, float_out=float_out)
    num_pairs = num_tokens * top_k
    block_m = block_rows(num_pairs, num_experts)
    sorted_pairs, block_expert = align(experts, num_experts, block_m)
    act = grouped_gemm(
        h,
        gate_up,
        sorted_pairs,
        block_expert,
        num_pairs=num_pairs,
        a_row_div=top_k,
        block_m=block_m,
        gated=GATED_GEMM,
    )  # [T k, I] (gate | up [T k, 2I] without GATED_GEMM)
    mixed = grouped_gemm(
        act if GATED_GEMM else silu_and_mul(act),
        down,
        sorted_pairs,
        block_expert,
        num_pairs=num_pairs,
        a_row_div=1,
        block_m=block_m,
        scale=weights.flatten(),
    )  # [T k, hidden], each row times its routing weight
    return mixed.view(num_tokens, top_k, hidden).sum(dim=1)
