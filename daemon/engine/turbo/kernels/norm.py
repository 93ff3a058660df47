"""RMSNorm, optionally fused with the residual add before it (one pass over the row), and
optionally making its output's per-token e4m3 codes for an FP8 product (rms_norm_fp8)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.fp8_quant import e4m3_codes, row_scale
from lmd.engine.turbo.quant.fp8 import Fp8Rows


@triton.jit
def _rms_norm_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    stride_x,
    stride_res,
    stride_out,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    FP8: tl.constexpr,
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
    if FP8:  # the codes of y as rms_norm would store it: quantize_per_token's, to the bit
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale, inverse = row_scale(tl.max(tl.abs(y), axis=0))
        tl.store(scale_ptr + row, scale)
        y = e4m3_codes(y, inverse)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """RMSNorm of x: [T, H] -> [T, H] (x's dtype); weight: [H].

    With `residual` ([T, H]), first `residual += x` in place, then normalize the sum:
    the pre-norm decoder's "add the sublayer's output, normalize for the next one".
    """
    out = torch.empty_like(x)
    _launch(x, weight, eps, residual, out=out, scale=None)
    return out


def rms_norm_fp8(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Fp8Rows:
    """rms_norm's output quantized per token in the same launch: what
    fp8_quant.quantize_per_token(rms_norm(...)) returns, bit for bit, without the
    16-bit row's round trip through memory and the quantizer's launch."""
    out = Fp8Rows(
        torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
        torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device),
    )
    _launch(x, weight, eps, residual, out=out.codes, scale=out.scale)
    return out


def _launch(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None,
    *,
    out: Tensor,
    scale: Tensor | None,
) -> None:
    num_rows, num_cols = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows with unit stride")
    if num_rows == 0:
        return
    block = triton.next_power_of_2(num_cols)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        scale if scale is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        num_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        FP8=scale is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
