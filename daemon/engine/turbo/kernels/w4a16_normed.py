"""One decode row's 4-bit product with the RMSNorm before it in one launch: the rows
kernel's normed entries (native/kernels/w4a16_rows.cu), each CTA making x = RMSNorm(x +
residual) in its shared memory from one round trip through L2 while its first words are
on their way. `W4A16Weight.matmul_normed` calls it for TurboModel's one-row steps
(`w4a16_norms`): the norm's own launch saved before qkv and gate|up (docs/benchmarks.md,
"A 4-bit one-row product with its RMSNorm")."""

from __future__ import annotations

import torch
from torch import Tensor

from lmd._native import w4a16_rows_normed
from lmd.engine.turbo.kernels.native_kernels import device_index
from lmd.engine.turbo.kernels.w4a16_rows import Packed, default_warps, num_sms, rows_take

NORMED_MAX_K = 16384  # x's one row in shared memory
NORMED_K_PER_WARP = 1024  # ... loaded at once, 4 chunks of 8 inputs a thread


def native_normed(  # noqa: PLR0917  # the norm's tensors, then the product's
    x: Tensor,
    gamma: Tensor,
    eps: float,
    residual: Tensor | None,
    summed: Tensor | None,
    weight: Packed,
    bias: Tensor | None,
    y: Tensor,
    *,
    gated: bool = False,
    warps: int | None = None,
) -> bool:
    """y [1, N] = RMSNorm(x + residual) W^T (+ b) (RMSNorm(x) without a residual; the
    norm's weight gamma [K], eps; W the 4-bit `weight`, its qweight, scales, zeros and
    group size as W4A16Weight holds them), the norm made in the product's launch (the
    rows kernel's normed entries): what rms_norm and native_rows give apart, to the norm's
    order of summing squares; `summed` ([1, K], or None) receives x + residual as rms_norm
    leaves its residual. True once enqueued, False (nothing written) where the kernel does
    not take it: one row, K <= NORMED_MAX_K and NORMED_K_PER_WARP a warp (by default,
    warps enough for that), x, residual, gamma and summed of x's dtype, contiguous and
    16-byte aligned, summed a tensor of its own; the rest as native_rows."""
    k = x.shape[1]
    inputs = [t for t in (x, residual) if t is not None]
    vectors = inputs if summed is None else [*inputs, summed]
    takes = (
        x.shape[0] == 1
        and k <= NORMED_MAX_K
        and tuple(gamma.shape) == (k,)
        and all(tuple(t.shape) == (1, k) for t in vectors)
        and all(
            t.dtype == x.dtype and t.is_contiguous() and t.data_ptr() % 16 == 0
            for t in (*vectors, gamma)
        )
        and (summed is None or all(summed.data_ptr() != t.data_ptr() for t in inputs))
    )
    if not takes:
        return False
    if not rows_take(x, weight, bias, y, gated):
        return False
    qweight, scales, zeros, _ = weight
    n, device = qweight.shape[1], device_index(x.device)
    if warps is None:  # default_warps', or as many more as the norm's loads need
        warps = max(default_warps(1, n, k, num_sms(device)), -(-k // NORMED_K_PER_WARP))
    if k > NORMED_K_PER_WARP * warps:
        return False
    w4a16_rows_normed(
        device,
        x.data_ptr(),
        0 if residual is None else residual.data_ptr(),
        gamma.data_ptr(),
        0 if summed is None else summed.data_ptr(),
        eps,
        qweight.data_ptr(),
        scales.data_ptr(),
        zeros.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        n,
        k,
        x.dtype == torch.bfloat16,
        warps,
        torch.cuda.current_stream(x.device).cuda_stream,
        gated,
    )
    return True
