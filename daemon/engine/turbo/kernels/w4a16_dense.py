"""The W4A16 product for many rows (kernels/w4a16.py's route from DENSE_ROWS rows): a
slab of W at a time dequantized to x's dtype, then cuBLAS multiplies. Past a few hundred
rows the product is bound by the tensor cores, where the fused tiles, which dequantize
every weight once per row tile, ran at a third of cuBLAS. Layout: w4a16.py's docstring.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

PACK_K = 128  # inputs per block of the layout (w4a16.py imports it from here)
SLAB_BYTES = 64 << 20  # the most a dequantized slab of W takes
DEQUANT_BLOCK_N = 64


@triton.jit
def _dequant_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    q_ptr,
    s_ptr,
    z_ptr,
    w_ptr,
    n,
    n0,
    width,
    stride_qe,
    stride_se,
    stride_we,
    stride_wk,
    stride_wc,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """w[k, c] = W[n0 + c, k] for c < width: one block of 128 inputs, BLOCK_N columns,
    w's element (k, c) at k * stride_wk + c * stride_wc, in its dtype; of a stack of
    experts (the grid's third axis; each W's words, scales and zeros and each w
    stride_qe, stride_se, stride_we apart), each's."""
    e = tl.program_id(2).to(tl.int64)
    q_ptr += e * stride_qe
    s_ptr += e * stride_se
    z_ptr += e * stride_se
    w_ptr += e * stride_we
    kb = tl.program_id(0) * 128
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < width
    cols = n0 + offs
    r = tl.arange(0, 16)
    words = tl.load(
        q_ptr + (kb // 8 + r)[:, None].to(tl.int64) * n + cols[None, :], mask=ok[None, :]
    )
    for j in tl.static_range(8):
        group = ((kb + 16 * j) // GROUP) * n
        s = tl.load(s_ptr + group + cols, mask=ok).to(tl.float32)
        z = tl.load(z_ptr + group + cols, mask=ok).to(tl.float32)
        w = (((words >> (4 * j)) & 0xF).to(tl.float32) - z[None, :]) * s[None, :]  # [16, BN]
        out = (
            w_ptr + (kb + 16 * j + r)[:, None].to(tl.int64) * stride_wk + offs[None, :] * stride_wc
        )
        tl.store(out, w.to(w_ptr.dtype.element_ty), mask=ok[None, :])


def dequantize_slab(
    qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int, *, n0: int, width: int
) -> Tensor:
    """Output columns n0 .. n0 + width of W, transposed: [K, width] in scales' dtype."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(k, width, dtype=scales.dtype, device=qweight.device)
    grid = (k // PACK_K, triton.cdiv(width, DEQUANT_BLOCK_N), 1)
    _dequant_kernel[grid](
        qweight, scales, zeros, w, n, n0, width, 0, 0, 0, width, 1, GROUP=group_size,
        BLOCK_N=DEQUANT_BLOCK_N,
    )  # fmt: skip
    return w


def dequantize_experts(
    qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int, *, lo: int, hi: int
) -> Tensor:
    """Experts lo .. hi - 1 of a 4-bit stack (quant/w4a16_experts.py: qweight [E, K / 8,
    N]) as 16-bit experts, [hi - lo, N, K] in scales' dtype."""
    k, n = qweight.shape[1] * 8, qweight.shape[2]
    w = torch.empty(hi - lo, n, k, dtype=scales.dtype, device=qweight.device)
    grid = (k // PACK_K, triton.cdiv(n, DEQUANT_BLOCK_N), hi - lo)
    _dequant_kernel[grid](
        qweight[lo], scales[lo], zeros[lo], w, n, 0, n, qweight.stride(0), scales.stride(0),
        w.stride(0), 1, k, GROUP=group_size, BLOCK_N=DEQUANT_BLOCK_N,
    )  # fmt: skip
    return w


def dense_matmul(  # noqa: PLR0917
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    group_size: int,
    bias: Tensor | None,
    y: Tensor,
) -> Tensor:
    """y = x @ W^T (+ bias) a slab of W's rows at a time: dequantized to x's dtype (at
    most SLAB_BYTES), then cuBLAS writes y's columns of the slab."""
    k, n = x.shape[1], qweight.shape[1]
    width = max(64, min(n, SLAB_BYTES // (2 * k)) // 64 * 64)
    for n0 in range(0, n, width):
        cols = min(width, n - n0)
        slab = dequantize_slab(qweight, scales, zeros, group_size, n0=n0, width=cols)  # [K, cols]
        out = y[:, n0 : n0 + cols]
        if bias is None:
            torch.mm(x, slab, out=out)
        else:
            torch.addmm(bias[n0 : n0 + cols], x, slab, out=out)
    return y
