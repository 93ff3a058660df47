"""The sum over k of a layer of experts (kernels/moe.py): each token's k weighted rows of
down's output, in pair order (token t's rows t k .. t k + k - 1), summed in float32 and
rounded once to their dtype, as torch's sum over that dimension does. One launch of
(tokens, hidden / BLOCK) programs, each loading its k rows' columns at once: 1.6, 2.4
and 3.9 us at 2, 8 and 256 tokens of Qwen3-30B-A3B's experts on an H200, where torch's
reduction over the middle dimension of [T, k, hidden] took 4.5, 4.6 and 7.2
(docs/benchmarks.md, "The sum over k ... in one Triton launch").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Off: torch's sum (scripts/moe_tiles.py --torch-sum measures it against this kernel).
TRITON_SUM = True
BLOCK = 1024  # columns a program


@triton.jit
def _sum_kernel(  # noqa: PLR0917  # a Triton kernel: positional arguments
    rows_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, BLOCK_K)
    mask = (j < TOP_K)[:, None] & (cols < hidden)[None, :]
    rows = rows_ptr + (token * TOP_K + j[:, None]) * hidden + cols[None, :]
    total = tl.sum(tl.load(rows, mask=mask, other=0.0).to(tl.float32), axis=0)
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty),
             mask=cols < hidden)  # fmt: skip


def sum_over_k(rows: Tensor, num_tokens: int, top_k: int) -> Tensor:
    """rows [T k, hidden] (contiguous, pair t k + j of token t) -> [T, hidden], each
    token's k rows summed."""
    hidden = rows.shape[1]
    if rows.shape[0] != num_tokens * top_k:
        raise ValueError(f"{rows.shape[0]} rows are not {num_tokens} tokens' {top_k} each")
    if not TRITON_SUM or not rows.is_contiguous():
        return rows.view(num_tokens, top_k, hidden).sum(dim=1)
    out = torch.empty(num_tokens, hidden, dtype=rows.dtype, device=rows.device)
    if num_tokens == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(hidden))
    _sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        rows, out, hidden, TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK=block,
        num_warps=4,
    )  # fmt: skip
    return out
