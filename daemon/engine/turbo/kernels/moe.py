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
FP8 experts (quant/fp8_experts.py) are read as codes; past FP8_CODES_ROWS rows a block
each GEMM's input is quantized too (a launch) and the products run on fp8 tensor cores.
W4A16 experts (quant/w4a16_experts.py) are read as 4-bit words, made 16-bit weights in
registers, the products on 16-bit tensor cores: on a GPU blocks of 8 or 16 rows by
native/kernels/w4a16_experts.cu (kernels/w4a16_rows.py native_experts), on Hopper blocks
of 64 by native/kernels/w4a16_wgmma.cu's experts entry (gate|up's SiLU in the launch
either way); elsewhere from W4_DEQUANT_ROWS rows by 16-bit slabs
made from the words, else by the grouped GEMM (a dot per nibble's 16 inputs, or one per
128 inputs).
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.activation import gate_up_rows, gated, silu_and_mul
from lmd.engine.turbo.kernels.common import expert_scales
from lmd.engine.turbo.kernels.fp8_quant import quantize_per_token, quantize_per_token_group
from lmd.engine.turbo.kernels.moe_align import align, block_rows, native_blocks
from lmd.engine.turbo.kernels.moe_sum import sum_over_k
from lmd.engine.turbo.kernels.routing import route
from lmd.engine.turbo.kernels.w4a16 import PACKED_NIBBLES, four_bit_slice
from lmd.engine.turbo.kernels.w4a16_dense import SLAB_BYTES, dequantize_experts
from lmd.engine.turbo.kernels.w4a16_rows import NATIVE_EXPERTS_ROWS, native_experts
from lmd.engine.turbo.quant.fp8_experts import Fp8Experts, Operands, kernel_operands
from lmd.engine.turbo.quant.load import Experts
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts


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
    expert_lo,  # w holds experts lo .. hi - 1 (its first at w_ptr); blocks of others return
    expert_hi,
    stride_c,
    ws_ptr,  # FP8: the codes' scales and their strides (fp8_experts.Operands)
    stride_se,
    stride_sn,
    stride_sk,
    as_ptr,  # A_FP8: a's scales, a token's (stride_ag 0) or its 128-groups'
    stride_ar,
    stride_ag,
    zs_ptr,  # W4: the zero points [E, K / G, N] (ws_ptr the scales, alike)
    stride_ze,
    A_ROW_DIV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALES: tl.constexpr,  # w: 16-bit (0), or e4m3 codes, a scale a row (1) or blocks (128)
    A_FP8: tl.constexpr,  # a is e4m3 codes too (FP8 only): fp8 tensor-core dots
    GATED: tl.constexpr,  # w is gate | up [E, 2I, K]: write silu(gate) * up, [P, I]
    W4_GROUP: tl.constexpr,  # w is 4-bit words [E, K / 8, N] in groups of this (0: not)
    W4_SCALE_AFTER: tl.constexpr,  # W4: a dot per 16 inputs, scaled once a group (decode)
    PACKED: tl.constexpr,  # W4: nibbles to 16-bit floats two at a time (CUDA)
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < expert_lo or expert >= expert_hi:  # -1: past the last expert's run
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
    w_base = w_ptr + (expert - expert_lo) * stride_we
    ws_at = ws_ptr + expert * stride_se
    zs_at = zs_ptr + expert * stride_ze
    as_at = as_ptr + a_row * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_rows = a_ptr + a_row[:, None] * stride_a
    dtype: tl.constexpr = c_ptr.dtype.element_ty  # the inputs' too, but for FP8 codes
    for k0 in range(0, k, BLOCK_K):
        if W4_GROUP:  # BLOCK_K 128
            acc = four_bit_slice(
                acc, a_rows, real, w_base, stride_wn, ws_at, zs_at, k0, n, cols, valid,
                W4_GROUP, W4_SCALE_AFTER, dtype, PACKED, PRECISION,
            )  # fmt: skip
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_rows + ks[None, :], mask=real[:, None] & (ks[None, :] < k), other=0.0
            )  # [BLOCK_M, BLOCK_K]
            w = tl.load(
                w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                mask=valid[None, :] & (ks[:, None] < k),
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]
            if SCALES > 1:  # each block of K its own scale (and a's group's)
                both = expert_scales(ws_at, cols, k0, stride_sn, stride_sk, valid, SCALES)[None, :]
                if A_FP8:
                    a_scales = tl.load(as_at + (k0 // SCALES) * stride_ag, mask=real, other=0.0)
                    both *= a_scales[:, None]
                acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * both
            else:  # (A_FP8: w already e4m3, a's dtype)
                acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    if SCALES == 1:  # a scale a row: the whole sum scaled once
        acc *= expert_scales(ws_at, cols, 0, stride_sn, 0, valid, SCALES)[None, :]
        if A_FP8:
            acc *= tl.load(as_at, mask=real, other=0.0)[:, None]
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + pair, mask=real, other=0.0).to(tl.float32)[:, None]
    c_rows = c_ptr + pair.to(tl.int64)[:, None] * stride_c
    if GATED:  # each product rounded first, as silu_and_mul reads it
        gate, up = tl.split(tl.reshape(acc.to(dtype), (BLOCK_M, BLOCK_N // 2, 2)))
        half = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        act = gated(gate, up, False).to(dtype)
        tl.store(c_rows + half[None, :], act, mask=real[:, None] & (half[None, :] < n // 2))
    else:
        tl.store(c_rows + cols[None, :], acc.to(dtype), mask=real[:, None] & valid[None, :])


def grouped_gemm(
    a: Tensor,
    weight: Experts,
    sorted_pairs: Tensor | None,
    block_expert: Tensor,
    *,
    num_pairs: int,
    a_row_div: int,
    block_m: int,
    scale: Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
    gated: bool = False,
    a_scale: Tensor | None = None,
) -> Tensor:
    """out[p] = a[p // a_row_div] @ weight[expert of p]^T (* scale[p]) for every pair p.

    a: [R, K]; weight: [E, N, K]; scale: [P] float32 or None -> out [num_pairs, N] in
    a's dtype. Rows of pairs no block holds are left unwritten (there are none when
    `sorted_pairs` comes from `align`; None, for the native W4A16 kernel alone: block p
    holds pair p). `tiles`: (BLOCK_N, BLOCK_K, warps, stages), to try others than the
    default. `gated`: weight is gate | up (N = 2I) and out [P, I]
    is silu_and_mul of the product, made in the same launch (a program's columns are
    its outputs' gate and up rows side by side), bit for bit the two launches' values.
    Fp8Experts: each BLOCK_K slice's product with the codes is scaled by its block's (or
    row's) scale, BLOCK_K at most 128. `a_scale` (Fp8Experts only): a is e4m3 codes,
    a ~= codes * a_scale, a_scale [R, 1] (per token, for a scale a row) or [R, ceil(K /
    128)] (per 128-group, for blocks), as `fp8_input` makes them; out in the experts'
    dtype. W4A16Experts: blocks of 8, 16 (and on Hopper 64) rows through the native
    experts kernels where they take them (no `tiles`; 8-row blocks only so), else BLOCK_K
    128 (a slice's 16 rows of words).
    """
    _, n, k = weight.shape
    if isinstance(weight, W4A16Experts):  # the words; the scales at FP8's, the zeros own
        w4, ops = (
            weight,
            Operands(weight.qweight, (weight.scales, weight.scales.stride(0), 0, 0), 0),
        )
    else:
        w4, ops = None, kernel_operands(weight, a)
    if a.shape[1] != k or a.stride(1) != 1 or ops.codes.stride(2) != 1:
        raise ValueError(f"grouped_gemm: a {tuple(a.shape)} against weights {tuple(weight.shape)}")
    if gated and (n % 2 or scale is not None):
        raise ValueError("grouped_gemm's gated takes gate | up rows and no scale")
    if a_scale is not None and not isinstance(weight, Fp8Experts):
        raise ValueError("grouped_gemm takes fp8 codes for a against FP8 experts only")
    out_dtype = a.dtype if isinstance(weight, Tensor) else weight.dtype
    if out_dtype != a.dtype and a_scale is None:
        raise ValueError(f"grouped_gemm: a in {a.dtype} against experts in {out_dtype}")
    if w4 is not None and tiles is None and block_m in NATIVE_EXPERTS_ROWS:
        fused = gated and n % 64 == 0  # the SiLU in the native kernel
        product = torch.empty(num_pairs, n // 2 if fused else n, dtype=out_dtype, device=a.device)
        if native_experts(a, w4.qweight, w4.scales, w4.zeros, w4.group_size, sorted_pairs,
                          block_expert, product, row_div=a_row_div, block_m=block_m,
                          weights=scale, gated=fused):  # fmt: skip
            return silu_and_mul(product) if gated and not fused else product
    if block_m < 16 or sorted_pairs is None:
        raise ValueError(f"grouped_gemm: blocks of {block_m} rows take the native W4A16 kernel")
    out = torch.empty(num_pairs, n // 2 if gated else n, dtype=out_dtype, device=a.device)
    launch = partial(_launch, a, out=out, sorted_pairs=sorted_pairs, block_expert=block_expert,
                     num_pairs=num_pairs, a_row_div=a_row_div, block_m=block_m, scale=scale,
                     gated=gated, a_scale=a_scale)  # fmt: skip
    if w4 is None or tiles is not None or block_m < W4_DEQUANT_ROWS:
        launch(ops, w4, tiles, (ops.codes.stride(0), ops.codes.stride(1)), (0, weight.shape[0]))
        return out
    per_slab = max(1, SLAB_BYTES // (n * k * a.element_size()))
    for lo in range(0, weight.shape[0], per_slab):  # 16-bit experts a slab at a time
        hi = min(lo + per_slab, weight.shape[0])
        slab = dequantize_experts(w4.qweight, w4.scales, w4.zeros, w4.group_size, lo=lo, hi=hi)
        launch(kernel_operands(slab, a), None, None, (slab.stride(0), slab.stride(1)), (lo, hi))
    return out


def _launch(  # noqa: PLR0917  # grouped_gemm's arguments, a weight's operands
    a: Tensor,
    ops: Operands,
    w4: W4A16Experts | None,
    tiles: tuple[int, int, int, int] | None,
    strides: tuple[int, int],
    experts: tuple[int, int],
    *,
    out: Tensor,
    sorted_pairs: Tensor,
    block_expert: Tensor,
    num_pairs: int,
    a_row_div: int,
    block_m: int,
    scale: Tensor | None,
    gated: bool,
    a_scale: Tensor | None,
) -> None:
    """_grouped_gemm_kernel on grouped_gemm's arguments for the weight `ops` (its
    experts' stride and its outputs'), which holds experts lo .. hi - 1."""
    n, k = out.shape[1] * (2 if gated else 1), a.shape[1]
    # The fastest at Qwen3-30B-A3B's shapes on an H200 (scripts/moe_tiles.py): 64 x 128
    # for decode's few rows per expert (~4 TB/s), 128 x 64 for 64-row blocks, 256 x 64
    # on 8 warps for a prefill's 128-row blocks (1.2x 64-row blocks at 4-8k tokens).
    # FP8 codes against FP8 experts, 128-row blocks: 128 x 128 on 8 warps in 4 stages for
    # blocks (1.6 against 3.6 ms at 4,096 tokens), 128 x 64 so for a scale a row; 64-row
    # blocks (1,024 tokens): 64 x 128 on 4 warps in 4 stages for blocks (299 against 366
    # us), 128 x 128 on 8 warps in 3 for a scale a row (205 against 261).
    if block_m >= 128 and a_scale is not None:
        default = (128, 128 if ops.scales > 1 else 64, 8, 4)
    elif block_m >= 64 and a_scale is not None:
        default = (64, 128, 4, 4) if ops.scales > 1 else (128, 128, 8, 3)
    elif block_m >= 128:
        default = (min(256, triton.next_power_of_2(n)), 64, 8, 3)
    elif block_m >= 64:
        default = (128, 64, 4, 3)
    else:
        default = (64 if n >= 1024 else 32, 128, 4, 3)
    block_n, block_k, num_warps, num_stages = tiles or default
    if w4 is not None:
        block_k = 128
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        ops.codes,
        out,
        scale if scale is not None else a,
        sorted_pairs,
        block_expert,
        num_pairs,
        n,
        k,
        a.stride(0),
        *strides,
        *experts,
        out.stride(0),
        *ops.scale_args,
        a_scale if a_scale is not None else a,
        a_scale.stride(0) if a_scale is not None else 0,
        a_scale.stride(1) if a_scale is not None else 0,
        *((w4.zeros, w4.zeros.stride(0)) if w4 is not None else (a, 0)),
        A_ROW_DIV=a_row_div,
        HAS_SCALE=scale is not None,
        SCALES=ops.scales,
        A_FP8=a_scale is not None,
        GATED=gated,
        W4_GROUP=w4.group_size if w4 is not None else 0,
        W4_SCALE_AFTER=w4 is not None and block_m <= W4_SCALE_AFTER_ROWS,
        PACKED=PACKED_NIBBLES and a.is_cuda and a.dtype != torch.float32,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # float32: no TF32 rounding
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=ops.block_k(block_k),
        num_warps=num_warps,
        num_stages=num_stages,
    )


# 4-bit experts in blocks of up to this many rows (past the native kernel's) take the dense
# W4A16 kernel's decode form (w4a16.scaled_after_dots), larger ones block_weights' one dot
# a block of 128 inputs: at 64 tokens (16-row blocks) 416 against 521 us a layer.
W4_SCALE_AFTER_ROWS = 32

# From this many rows a block (past 2,048 tokens of Qwen3-30B-A3B a step), 4-bit experts
# are made 16-bit a slab of experts at a time (w4a16_dense.SLAB_BYTES at most, by
# w4a16_dense.dequantize_experts), and the 16-bit grouped GEMM multiplies each slab's
# blocks, as the dense W4A16 path hands cuBLAS dequantized slabs from DENSE_ROWS rows. A
# layer at 4,096 tokens (H200): 1,748 us against block_weights' tiles' 1,988 (16-bit
# experts 915); at 1,024 (64-row blocks) 1,118 against the tiles' 880, so not there.
W4_DEQUANT_ROWS = 128


# FP8 experts' inputs as e4m3 codes too (fp8 tensor cores) from this many rows a block up:
# every grouped GEMM (one token takes kernels/moe_vector.py's path). The codes took a layer
# of Qwen3-30B-A3B's experts at 64 / 256 / 4,096 tokens 216 / 302 / 1,413 -> 180 / 196 /
# 772 us (a scale a row), 253 / 363 / 3,565 -> 191 / 244 / 3,742 (blocks; H200,
# scripts/moe_tiles.py --codes-rows; 16-bit experts: 296 / 342 / 934). Codes widened to
# 16 bits instead: set it past block_rows' 128.
FP8_CODES_ROWS = 16


def fp8_input(x: Tensor, weight: Experts, block_m: int) -> tuple[Tensor, Tensor | None]:
    """A grouped GEMM's input as it takes it: x (16-bit), or for FP8 experts at
    FP8_CODES_ROWS rows a block or more, x's e4m3 codes and scales, per token for a scale
    a row, per 128-group for blocks (kernels/fp8_quant.py)."""
    if not isinstance(weight, Fp8Experts) or block_m < FP8_CODES_ROWS:
        return x, None
    if weight.block_size is None:
        return quantize_per_token(x)
    return quantize_per_token_group(x)


# SiLU-and-multiply made in gate|up's grouped GEMM (`gated`), one launch and a [T k, 2I]
# round trip through memory fewer a layer (a 16 x 512-token prefill step of the
# Qwen3-30B-A3B shape: kernels 118.3 -> 113.9 ms on an H200). Off: the SiLU in its own
# launch (scripts/prefill_profile.py --separate-moe-activation times it so).
GATED_GEMM = True


def fused_moe(
    h: Tensor,
    router: Tensor,
    gate_up: Experts,
    down: Experts,
    *,
    top_k: int,
    normalize: bool,
    float_out: bool = False,
) -> Tensor:
    """h: [T, hidden]; router: [E, hidden]; gate_up: [E, 2 I, hidden]; down:
    [E, hidden, I] (16-bit as h, FP8 or W4A16) -> [T, hidden] in h's dtype. `float_out`:
    torch.mm can take the router's product straight to float32 (route)."""
    if h.shape[0] == 0:
        return torch.empty_like(h)
    weights, experts = route(h, router, top_k, normalize, float_out=float_out)
    return routed_moe(h, weights, experts, gate_up, down, num_experts=router.shape[0])


def routed_moe(
    h: Tensor,
    weights: Tensor,
    experts: Tensor,
    gate_up: Experts,
    down: Experts,
    *,
    num_experts: int,
) -> Tensor:
    """fused_moe after its router: h [T, hidden] through its chosen experts [T, k] int32,
    each product times its weight [T, k] float32, summed over k -> [T, hidden]. One
    token's 4-bit pairs (a block each, no layout) are summed in down's launch (the native
    kernel's `mixed`)."""
    num_tokens, hidden = h.shape
    top_k = experts.shape[1]
    num_pairs = num_tokens * top_k
    block_m = block_rows(num_pairs, num_experts, native=native_blocks(h, gate_up, down))
    if num_tokens == 1 and block_m == 8:  # a block a pair, its experts distinct: no layout
        sorted_pairs, block_expert = None, experts.view(-1)
    else:
        sorted_pairs, block_expert = align(experts, num_experts, block_m)
    layout = partial(grouped_gemm, sorted_pairs=sorted_pairs, block_expert=block_expert,
                     num_pairs=num_pairs, block_m=block_m)  # fmt: skip
    a, a_scale = fp8_input(h, gate_up, block_m)
    act = layout(a, gate_up, a_row_div=top_k, gated=GATED_GEMM, a_scale=a_scale)
    act = act if GATED_GEMM else silu_and_mul(act)  # [T k, I]
    if sorted_pairs is None and isinstance(down, W4A16Experts):  # one token: the sum over k
        mixed = torch.empty(1, hidden, dtype=act.dtype, device=act.device)
        if native_experts(act, down.qweight, down.scales, down.zeros, down.group_size, None,
                          block_expert, mixed, row_div=1, block_m=8, weights=weights.flatten(),
                          mixed=True):  # fmt: skip
            return mixed
    a, a_scale = fp8_input(act, down, block_m)  # each row times its routing weight:
    mixed = layout(a, down, a_row_div=1, scale=weights.flatten(), a_scale=a_scale)
    return sum_over_k(mixed, num_tokens, top_k)
