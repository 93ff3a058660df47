"""A token's experts from its router's logits: softmax, then the k largest (kernels/moe.py's
`route` for a step's tokens; vector_gemv's `Route` for one token, in the router's own
launch).

`choose` ranks each expert by how many logits come before it (larger, or equal with a
lower id), reading the logits one at a time as uniform loads against the program's
vector of them: no reduction between threads but the softmax's, where TOP_K rounds of
a maximum and a minimum took two each. The first TOP_K write themselves at their rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def choose(  # noqa: PLR0917  # a Triton function: positional arguments
    logits_ptr,
    num_experts,
    weights_ptr,
    experts_ptr,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """A token's routing from its float32 logits, written to experts_ptr ([TOP_K] int32)
    and weights_ptr ([TOP_K] float32): slot j the expert with the j-th largest logit
    (the lowest id among equals) and its softmax probability, the TOP_K of them scaled
    to sum to 1 if NORMALIZE (ranked as the module docstring says). The loads read L2
    (.cg): a router's other programs may have written the logits in the same launch."""
    e = tl.arange(0, BLOCK_E)
    real = e < num_experts
    logits = tl.load(logits_ptr + e, mask=real, other=-float("inf"), cache_modifier=".cg")
    rank = tl.zeros([BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(BLOCK_E):
        other = tl.load(
            logits_ptr + j, mask=j < num_experts, other=-float("inf"), cache_modifier=".cg"
        )
        rank += ((other > logits) | ((other == logits) & (j < e))).to(tl.int32)
    x = tl.exp(logits - tl.max(logits, axis=0))
    probs = x / tl.sum(x, axis=0)
    chosen = real & (rank < TOP_K)
    if NORMALIZE:
        probs = probs / tl.sum(tl.where(chosen, probs, 0.0), axis=0)
    tl.store(weights_ptr + rank, probs, mask=chosen)
    tl.store(experts_ptr + rank, e, mask=chosen)


@triton.jit
def choose_when_last(  # noqa: PLR0917  # a Triton function: positional arguments
    logits_ptr,
    num_experts,
    count_ptr,
    weights_ptr,
    experts_ptr,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """In a launch whose programs each write part of a token's logits: after its part,
    each program counts itself done on count_ptr (an int32 at 0); the one that counts
    last chooses the experts from all of them (`choose`) and resets the count for the
    next launch."""
    tl.debug_barrier()  # every thread's logits stored before the count
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        choose(logits_ptr, num_experts, weights_ptr, experts_ptr, TOP_K, NORMALIZE, BLOCK_E)
        tl.store(count_ptr, 0)


@triton.jit
def _top_k_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    logits_ptr,
    weights_ptr,
    experts_ptr,
    num_experts,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    choose(
        logits_ptr + token * num_experts,
        num_experts,
        weights_ptr + token * TOP_K,
        experts_ptr + token * TOP_K,
        TOP_K,
        NORMALIZE,
        BLOCK_E,
    )


def route(
    h: Tensor, router: Tensor, top_k: int, normalize: bool, *, float_out: bool = False
) -> tuple[Tensor, Tensor]:
    """h: [T, hidden], router: [E, hidden] -> (weights [T, k] float32, experts [T, k]
    int32): the softmax's k largest probabilities, scaled to sum to 1 when `normalize`.

    The router's logits come out of the GEMM in float32 (`float_out`: torch.mm's
    out_dtype, else the product is widened after): rounded to bf16, as transformers
    keeps them, they flip the choice between near-tied experts, and a flip moves the
    layer's output by a whole expert's share. Softmax and top-k are one kernel."""
    if float_out:
        logits = torch.mm(h, router.t(), out_dtype=torch.float32)  # [T, E]
    else:
        logits = F.linear(h, router).float()
    return top_k_of(logits, top_k, normalize)


def top_k_of(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] float32 -> route's (weights [T, k], experts [T, k])."""
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} of {num_experts} experts")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    _top_k_kernel[(num_tokens,)](
        logits,
        weights,
        experts,
        num_experts,
        TOP_K=top_k,
        NORMALIZE=normalize,
        BLOCK_E=triton.next_power_of_2(num_experts),
    )
    return weights, experts
