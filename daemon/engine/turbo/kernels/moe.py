"""A layer of experts (Mixtral, Qwen3-MoE): route each token to k experts, run them, mix.

    probs = softmax(h @ Wrouter^T)                   # [T, E] float32
    weights, experts = top-k of probs                # [T, k], renormalized if asked
    for each (token t, choice j): y[t] += weights[t, j] * mlp_{experts[t, j]}(h[t])

The T * k (token, choice) pairs are numbered `t * k + j`. `align` sorts them by expert
and pads each expert's run to a multiple of BLOCK_M, so that every block of BLOCK_M
sorted pairs belongs to one expert; the grouped GEMM then runs all experts in one
launch, a program per (block, BLOCK_N output columns), each reading its expert's weight
tile once for all the block's rows. Gate/up and down are two such launches with the
SiLU-and-multiply between; the down launch scales each row by its routing weight and
the k rows of a token are summed.

Everything runs on the device without a host sync (the padded layout is sized for the
worst case), so a decode step with experts is captured in a CUDA graph as any other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.activation import silu_and_mul


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
    A_ROW_DIV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
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
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert * stride_we
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
            mask=(cols[None, :] < n) & (ks[:, None] < k),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + pair, mask=real, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + pair.to(tl.int64)[:, None] * stride_c + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=real[:, None] & (cols[None, :] < n),
    )


def route(h: Tensor, router: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """h: [T, hidden], router: [E, hidden] float32 -> (weights [T, k] float32, experts
    [T, k] int64): the softmax's k largest probabilities, scaled to sum to 1 when
    `normalize`. All in float32 (transformers takes the router's logits in the model's
    dtype): a bf16 product flips the choice between near-tied experts, and a flip moves
    the layer's output by a whole expert's share."""
    probs = torch.softmax(F.linear(h.float(), router.float()), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def align(experts: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """experts: [T, k] -> (sorted pairs [P] int32, expert of each block [P / block_m]).

    `sorted` lists the pair ids t * k + j by expert, each expert's run padded with the
    id T * k to a multiple of block_m; P is the worst case's length (each of the
    min(E, T k) experts that can be hit padded by block_m - 1), rounded up to a block.
    Blocks past the last run have expert -1.
    """
    flat = experts.flatten()  # [T k]
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pair ids by expert
    by_expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - start[by_expert]
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    length = triton.cdiv(worst, block_m) * block_m
    sorted_pairs = torch.full((length,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[by_expert] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, length, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def grouped_gemm(
    a: Tensor,
    weight: Tensor,
    sorted_pairs: Tensor,
    block_expert: Tensor,
    *,
    num_pairs: int,
    a_row_div: int,
    block_m: int,
    scale: Tensor | None = None,
) -> Tensor:
    """out[p] = a[p // a_row_div] @ weight[expert of p]^T (* scale[p]) for every pair p.

    a: [R, K]; weight: [E, N, K]; scale: [P] float32 or None -> out [num_pairs, N] in
    a's dtype. Rows of pairs no block holds are left unwritten (there are none when
    `sorted_pairs` comes from `align`).
    """
    _, n, k = weight.shape
    if a.shape[1] != k or a.stride(1) != 1 or weight.stride(2) != 1:
        raise ValueError(f"grouped_gemm: a {tuple(a.shape)} against weights {tuple(weight.shape)}")
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n = 64 if n >= 1024 else 32
    block_k = 128 if k >= 1024 else 64
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        weight,
        out,
        scale if scale is not None else a,
        sorted_pairs,
        block_expert,
        num_pairs,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        HAS_SCALE=scale is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # float32: no TF32 rounding
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
    )
    return out


def block_rows(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M for this many pairs: the rows an expert gets on average, at least 16
    (tl.dot's least) and at most 64; a decode step's few rows per expert waste less
    padding with small blocks, a prefill's many use the tensor cores better with big."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def fused_moe(
    h: Tensor,
    router: Tensor,
    gate_up: Tensor,
    down: Tensor,
    *,
    top_k: int,
    normalize: bool,
) -> Tensor:
    """h: [T, hidden]; router: [E, hidden]; gate_up: [E, 2 I, hidden]; down:
    [E, hidden, I] -> [T, hidden] in h's dtype."""
    num_tokens, hidden = h.shape
    num_experts = router.shape[0]
    if num_tokens == 0:
        return torch.empty_like(h)
    weights, experts = route(h, router, top_k, normalize)
    num_pairs = num_tokens * top_k
    block_m = block_rows(num_pairs, num_experts)
    sorted_pairs, block_expert = align(experts, num_experts, block_m)
    up = grouped_gemm(
        h,
        gate_up,
        sorted_pairs,
        block_expert,
        num_pairs=num_pairs,
        a_row_div=top_k,
        block_m=block_m,
    )  # [T k, 2I]
    mixed = grouped_gemm(
        silu_and_mul(up),
        down,
        sorted_pairs,
        block_expert,
        num_pairs=num_pairs,
        a_row_div=1,
        block_m=block_m,
        scale=weights.flatten(),
    )  # [T k, hidden], each row times its routing weight
    return mixed.view(num_tokens, top_k, hidden).sum(dim=1)
