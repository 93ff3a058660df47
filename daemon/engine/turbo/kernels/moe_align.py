"""The experts' block layout (kernels/moe.py): how many rows a block (block_rows), and
the (token, choice) pairs sorted by expert, each expert's run padded to a multiple of
BLOCK_M, so that every block of BLOCK_M sorted pairs belongs to one expert, and the expert
of each block (align); on the device, without a host sync (sized for the worst case), in
two launches after the counts' zeroing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.w4a16_rows import WGMMA_EXPERTS_ROWS, experts_blocks
from lmd.engine.turbo.quant.load import Experts
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts

# Blocks of 8 rows (the native W4A16 experts kernel's least) while the pairs an expert gets
# on average are at most this: fewer rows' products than 16-row blocks, but an expert
# with more than 8 pairs reads its weights once a block. At 1 / 8 / 16 / 32 tokens of
# Qwen3-30B-A3B (H200): 13.0 / 56.5 / 84.2 / 120.8 us against 19.5 / 96.3 / 146.4 / 212.3.
EIGHT_ROWS_UP_TO = 2
# 64-row blocks (the wgmma kernel's, Hopper) past this many pairs an expert on average,
# where 16-row ones took longer: at 64 / 96 / 128 / 192 / 256 tokens of Qwen3-30B-A3B
# (4-16 pairs an expert; H200, a layer's fused_moe) 218 / 224 / 225 / 231 / 234 us against
# 220 / 228 / 234 / 263 / 322 (scripts/moe_tiles.py --wgmma-past).
WGMMA_PAST = 4


def block_rows(num_pairs: int, num_experts: int, *, native: tuple[int, ...] = ()) -> int:
    """BLOCK_M for this many pairs: the rows an expert gets on average, at least 16
    (tl.dot's least) and at most 128; a decode step's few rows per expert waste less
    padding with small blocks, a prefill's many use the tensor cores better with big.
    `native`: the blocks the native W4A16 experts kernels take (native_blocks): 8 rows up
    to EIGHT_ROWS_UP_TO pairs an expert, and 64 (the wgmma kernel's) past WGMMA_PAST."""
    per_expert = num_pairs / num_experts
    if 8 in native and per_expert <= EIGHT_ROWS_UP_TO:
        return 8
    if WGMMA_EXPERTS_ROWS in native and per_expert > WGMMA_PAST:
        return WGMMA_EXPERTS_ROWS
    if per_expert <= 48:
        return 16 if per_expert <= 16 else 32
    return 64 if per_expert <= 128 else 128


def native_blocks(h: Tensor, gate_up: Experts, down: Experts) -> tuple[int, ...]:
    """The blocks of pairs (rows) the native W4A16 experts kernels take for both layers of
    experts with h as gate|up's input (kernels/w4a16_rows.py native_experts; down's, made
    by fused_moe, is contiguous): none unless both are 4-bit."""
    if not isinstance(gate_up, W4A16Experts) or not isinstance(down, W4A16Experts):
        return ()
    first, second = (experts_blocks(h, w.qweight, w.scales, w.group_size) for w in (gate_up, down))
    return tuple(rows for rows in first if rows in second)


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
