"""A layer of experts for one token (a batch-1 decode step), in four launches:

    1. the router's product with the layer's RMSNorm (and the residual add) folded in,
       float32 logits (kernels/vector_gemv.py with a `Norm`);
    2. softmax + top-k (kernels/moe.py's);
    3. gate|up of the k chosen experts with the activation folded in, one launch for all
       of them (vector_gemv with `experts` and `activation`): [k, I];
    4. down of the k experts and their mix (`_mix_down_kernel`): each program owns
       BLOCK_N output columns, streams those rows of each chosen expert's down in turn
       and adds its product, scaled by the routing weight, to the token's output.

kernels/moe.py's path (router GEMM, top-k, the block layout, two grouped GEMMs padded to
tl.dot's 16 rows, SiLU, the sum over k, and the norm before it: 8 launches) gives the
same values up to the order of float32 sums: each expert's product is scaled by its
weight and rounded to the activations' dtype before the k of them are added in float32
and rounded once, as there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.moe import top_k_of
from lmd.engine.turbo.kernels.vector_gemv import Norm, default_tiles, vector_gemv


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
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = cols < n
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        rows = w_ptr + tl.load(experts_ptr + j).to(tl.int64) * stride_e
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k
            w = tl.load(
                rows + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
                mask=valid[:, None] & kmask[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_K]
            x = tl.load(act_ptr + j * k + ks, mask=kmask, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        share = tl.sum(acc, axis=1) * tl.load(weights_ptr + j)
        total += share.to(dtype).to(tl.float32)  # each expert's share rounded, as moe.py's
    tl.store(y_ptr + cols, total.to(dtype), mask=valid)


def mix_down(
    act: Tensor,
    down: Tensor,
    experts: Tensor,
    weights: Tensor,
    tiles: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """act: [k, I] (row j: expert experts[j]'s activation), down: [E, H, I], experts:
    [k] int32, weights: [k] float32 -> [1, H]: sum over j of weights[j] * down[experts[j]]
    @ act[j], each term rounded to act's dtype. tiles: (BLOCK_N, BLOCK_K, warps, stages)
    instead of vector_gemv's default_tiles."""
    top_k, inner = act.shape
    _, n, k = down.shape
    if k != inner or experts.shape != (top_k,) or weights.shape != (top_k,):
        raise ValueError(f"mix_down: act {tuple(act.shape)} against down {tuple(down.shape)}")
    if not act.is_contiguous() or down.stride(2) != 1:
        raise ValueError("mix_down takes contiguous activations and rows of down")
    y = torch.empty(1, n, dtype=act.dtype, device=act.device)
    block_n, block_k, num_warps, num_stages = tiles or default_tiles(n, k)
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
        TOP_K=top_k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


def experts_vector(
    hidden: Tensor,
    norm: Norm,
    router: Tensor,
    gate_up: Tensor,
    down: Tensor,
    *,
    top_k: int,
    normalize: bool,
) -> Tensor:
    """hidden: [1, H] -> the layer of experts on RMSNorm(hidden (+ norm.residual)) [1, H]
    (the module docstring); norm.summed, if given, receives hidden + residual. router:
    [E, H]; gate_up: [E, 2I, H] (gate | up); down: [E, H, I]; the activation SiLU."""
    logits = vector_gemv(hidden, router, norm=norm, out_dtype=torch.float32)  # [1, E]
    weights, experts = top_k_of(logits, top_k, normalize)  # [1, k] each
    experts = experts.view(top_k)
    if norm.summed is not None:  # the experts' input: the stream after the add, normed
        hidden, norm = norm.summed, Norm(norm.weight, norm.eps)
    act = vector_gemv(hidden, gate_up, norm=norm, activation="silu", experts=experts)
    return mix_down(act, down, experts, weights.view(top_k))
