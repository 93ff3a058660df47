"""RMSNorm, optionally fused with the residual add before it (one pass over the row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_res,
    stride_out,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + res).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, summed, mask=mask)
        # Normalize the residual stream as stored, as transformers does.
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / num_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(variance + eps) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """RMSNorm of x: [T, H] -> [T, H] (x's dtype); weight: [H].

    With `residual` ([T, H]), first `residual += x` in place, then normalize the sum:
    the pre-norm decoder's "add the sublayer's output, normalize for the next one".
    """
    num_rows, num_cols = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows with unit stride")
    out = torch.empty_like(x)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(num_cols)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        num_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out
