"""A layer of experts for one token (a batch-1 decode step), in three launches:

    1. the router's product with the layer's RMSNorm (and the residual add) folded in,
       float32 logits, and the token's k experts chosen from them (softmax + top-k,
       kernels/routing.py's `choose`) by the last of its programs to finish
       (kernels/vector_gemv.py with a `Norm` and a `Route`);
    2. gate|up of the k chosen experts with the activation folded in, one launch for all
       of them (vector_gemv with `experts` and `activation`): [k, I];
    3. down of the k experts and their mix (`_mix_down_kernel`): each program owns
       BLOCK_N output columns and streams those rows of all k chosen experts' down at
       once (a [k, BLOCK_N, BLOCK_K] tile a slice of K, the loads of every expert in
       flight together), each expert's product scaled by its routing weight and added
       to the token's output.

kernels/moe.py's path (router GEMM, top-k, the block layout, two grouped GEMMs padded to
tl.dot's 16 rows, SiLU, the sum over k, and the norm before it: 10 launches) gives the
same values up to the order of float32 sums: each expert's product is scaled by its
weight and rounded to the activations' dtype before the k of them are added in float32
and rounded once, as there.

4-bit experts (W4A16Experts) take launch 1 with the normed row written too (vector_gemv's
`Norm.normed`), then moe.py's path after its router (routed_moe: a block a pair without
a layout through the native W4A16 experts kernel, gate|up with its SiLU, then down, each
product times its weight and summed over k in the same launch): three launches.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels import moe
from lmd.engine.turbo.kernels.common import expert_scales
from lmd.engine.turbo.kernels.vector_gemv import Norm, Route, vector_gemv
from lmd.engine.turbo.quant.fp8_experts import Fp8Experts, kernel_operands
from lmd.engine.turbo.quant.load import Experts
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts

# The mix's tiles (BLOCK_N, BLOCK_K, warps, stages): a program's k experts make a
# [k, BLOCK_N, BLOCK_K] float32 accumulator, so narrower than vector_gemv's. The
# fastest of scripts/gemv_bench.py --experts at Qwen3-30B-A3B's shape (H200): 8.3 us
# against 9.0-11.1 for the next.
MIX_TILES = (2, 128, 4, 4)


@triton.jit
def _mix_down_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    act_ptr,
    w_ptr,
    experts_ptr,
    weights_ptr,
    y_ptr,
    n,
    k,
    stride_e,
    stride_w,
    ws_ptr,  # FP8: the codes' scales and their strides (fp8_experts.Operands)
    stride_se,
    stride_sn,
    stride_sk,
    SCALES: tl.constexpr,  # 0: 16-bit; FP8 codes, a scale a row (1) or blocks (128)
    TOP_K: tl.constexpr,
    BLOCK_J: tl.constexpr,  # TOP_K to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = cols < n
    j = tl.arange(0, BLOCK_J)
    chosen = j < TOP_K
    ids = tl.load(experts_ptr + j, mask=chosen, other=0).to(tl.int64)
    rows = w_ptr + ids[:, None, None] * stride_e + cols[None, :, None].to(tl.int64) * stride_w
    ws_at = ws_ptr + ids[:, None] * stride_se  # FP8: each expert's scales, [J, 1]
    live_n = chosen[:, None] & valid[None, :]  # [J, N]
    live = live_n[:, :, None]
    acc = tl.zeros((BLOCK_J, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k
        w = tl.load(rows + ks[None, None, :], mask=live & kmask[None, None, :], other=0.0)
        x = tl.load(
            act_ptr + j[:, None] * k + ks[None, :], mask=chosen[:, None] & kmask[None, :], other=0.0
        )  # [J, BLOCK_K]: each expert's activation
        w = w.to(tl.float32)
        if SCALES:  # [J, BLOCK_N] scales of this slice
            ws = expert_scales(ws_at, cols[None, :], k0, stride_sn, stride_sk, live_n, SCALES)
            w *= ws[:, :, None]
        acc += w * x.to(tl.float32)[:, None, :]
    share = tl.sum(acc, axis=2) * tl.load(weights_ptr + j, mask=chosen, other=0.0)[:, None]
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    total = tl.sum(share.to(dtype).to(tl.float32), axis=0)  # each share rounded, as moe.py's
    tl.store(y_ptr + cols, total.to(dtype), mask=valid)


def mix_down(
    act: Tensor,
    down: Tensor | Fp8Experts,
    experts: Tensor,
    weights: Tensor,
    tiles: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """act: [k, I] (row j: expert experts[j]'s activation), down: [E, H, I], experts:
    [k] int32, weights: [k] float32 -> [1, H]: sum over j of weights[j] * down[experts[j]]
    @ act[j], each term rounded to act's dtype (down 16-bit as act, or Fp8Experts).
    tiles: (BLOCK_N, BLOCK_K, warps, stages) instead of MIX_TILES."""
    top_k, inner = act.shape
    _, n, k = down.shape
    ops = kernel_operands(down, act)
    down = ops.codes
    if k != inner or experts.shape != (top_k,) or weights.shape != (top_k,):
        raise ValueError(f"mix_down: act {tuple(act.shape)} against down {tuple(down.shape)}")
    if not act.is_contiguous() or down.stride(2) != 1:
        raise ValueError("mix_down takes contiguous activations and rows of down")
    y = torch.empty(1, n, dtype=act.dtype, device=act.device)
    block_n, block_k, num_warps, num_stages = tiles or MIX_TILES
    _mix_down_kernel[(triton.cdiv(n, block_n),)](
        act,
        down,
        experts,
        weights,
        y,
        n,
        k,
        down.stride(0),
        down.stride(1),
        *ops.scale_args,
        SCALES=ops.scales,
        TOP_K=top_k,
        BLOCK_J=triton.next_power_of_2(top_k),
        BLOCK_N=block_n,
        BLOCK_K=ops.block_k(min(block_k, triton.next_power_of_2(k))),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


def experts_vector(
    hidden: Tensor,
    norm: Norm,
    router: Tensor,
    gate_up: Experts,
    down: Experts,
    *,
    top_k: int,
    normalize: bool,
    count: Tensor,
) -> Tensor:
    """hidden: [1, H] -> the layer of experts on RMSNorm(hidden (+ norm.residual)) [1, H]
    (the module docstring); norm.summed, if given, receives hidden + residual. router:
    [E, H]; gate_up: [E, 2I, H] (gate | up); down: [E, H, I] (16-bit, or both FP8); the
    activation SiLU.
    count: [1] int32 at 0, the router's launch's counter (vector_gemv's `Route`).
    4-bit experts (both layers) go to moe.routed_moe after the router (the module
    docstring)."""
    if isinstance(gate_up, W4A16Experts) != isinstance(down, W4A16Experts):
        raise ValueError("experts_vector takes both layers of experts 4-bit or neither")
    device = hidden.device
    route = Route(
        count,
        torch.empty(top_k, dtype=torch.float32, device=device),
        torch.empty(top_k, dtype=torch.int32, device=device),
        normalize,
    )
    if isinstance(gate_up, W4A16Experts) or isinstance(down, W4A16Experts):  # (both: above)
        # the experts' input normed by the router's launch
        h = torch.empty_like(hidden)
        vector_gemv(hidden, router, norm=replace(norm, normed=h), out_dtype=torch.float32,
                    route=route)  # fmt: skip
        chosen = (route.weights.view(1, top_k), route.experts.view(1, top_k))
        return moe.routed_moe(h, *chosen, gate_up, down, num_experts=router.shape[0])
    vector_gemv(hidden, router, norm=norm, out_dtype=torch.float32, route=route)  # [1, E]
    if norm.summed is not None:  # the experts' input: the stream after the add, normed
        hidden, norm = norm.summed, Norm(norm.weight, norm.eps)
    act = vector_gemv(hidden, gate_up, norm=norm, activation="silu", experts=route.experts)
    return mix_down(act, down, route.experts, route.weights)
