"""RMSNorm, optionally fused with the residual add before it (one pass over the row), and
optionally making its output's e4m3 codes (per token, or per 128-group) for an FP8
product (rms_norm_fp8) or its columns in an act-order W4A16 weight's packed order; and
that gather alone (gather_columns) for a product whose input no norm makes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.fp8_quant import e4m3_codes, group_codes, row_scale
from lmd.engine.turbo.quant.fp8 import Fp8Rows


@triton.jit
def _rms_norm_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    order_ptr,
    num_rows,
    stride_x,
    stride_res,
    stride_out,
    stride_scale,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    FP8: tl.constexpr,
    GROUPS: tl.constexpr,
    ORDERED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A program a row; rows from num_rows on (FP8 codes padded for a product) are zeros."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    live = cols < tl.where(row < num_rows, num_cols, 0)  # a padding row reads nothing
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=live, other=0.0).to(tl.float32)
        summed = (x + res).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, summed, mask=live)
        # Normalize the residual stream as stored, as transformers does.
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / num_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(variance + eps) * w
    if ORDERED:  # column j of out is column order[j] of y, moved in registers
        y = tl.gather(y, tl.load(order_ptr + cols, mask=mask, other=0), axis=0)
    if FP8:  # the codes of y as rms_norm would store it: the quantizers', to the bit
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        if GROUPS:  # a scale a 128-group, column-major [groups, rows]
            y, scale = group_codes(y, BLOCK)
            g = tl.arange(0, BLOCK // 128)
            tl.store(scale_ptr + g * stride_scale + row, scale, mask=g * 128 < num_cols)
        else:
            scale, inverse = row_scale(tl.max(tl.abs(y), axis=0))
            tl.store(scale_ptr + row, scale)
            y = e4m3_codes(y, inverse)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def summed_row(  # noqa: PLR0917  # a Triton function: positional arguments
    x_ptr,
    res_ptr,
    summed_ptr,
    normed_ptr,
    w_ptr,
    squares,
    eps,
    k,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SUMMED: tl.constexpr,
    HAS_NORMED: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """In a program that has summed the squares of a row's (x + residual, rounded to its
    dtype) k elements into `squares` ([BLOCK_K] float32, by slices): writes x + residual
    to summed_ptr and its RMSNorm with weight w to normed_ptr, as _rms_norm_kernel
    rounds them (its squares summed in another order), BLOCK_K elements at a time."""
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / k + eps)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k
        x = tl.load(x_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(res_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
            x = x.to(res_ptr.dtype.element_ty).to(tl.float32)
        if HAS_SUMMED:
            tl.store(summed_ptr + ks, x.to(summed_ptr.dtype.element_ty), mask=kmask)
        if HAS_NORMED:
            w = tl.load(w_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
            tl.store(normed_ptr + ks, (x * rstd * w).to(normed_ptr.dtype.element_ty), mask=kmask)


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    *,
    order: Tensor | None = None,
) -> Tensor:
    """RMSNorm of x: [T, H] -> [T, H] (x's dtype); weight: [H].

    With `residual` ([T, H]), first `residual += x` in place, then normalize the sum:
    the pre-norm decoder's "add the sublayer's output, normalize for the next one".
    With `order` ([H] int64, a permutation) the output's columns in that order,
    out[:, j] = RMSNorm(x)[:, order[j]], the same values.
    """
    out = torch.empty_like(x)
    _launch(x, weight, eps, residual, out=out, scale=None, order=order)
    return out


@triton.jit
def _gather_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr, order_ptr, out_ptr, stride_x, num_cols, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    src = tl.load(order_ptr + cols, mask=mask, other=0)
    values = tl.load(x_ptr + row * stride_x + src, mask=mask)
    tl.store(out_ptr + row * num_cols + cols, values, mask=mask)


def gather_columns(x: Tensor, order: Tensor) -> Tensor:
    """x [T, H] (unit column stride) -> out [T, H], out[:, j] = x[:, order[j]]: one
    launch, a third of index_select's time in a graph (docs/benchmarks.md, "Act-order
    GPTQ checkpoints")."""
    num_rows, num_cols = x.shape
    if x.stride(1) != 1 or tuple(order.shape) != (num_cols,):
        raise ValueError(f"gather_columns of x {tuple(x.shape)} by order {tuple(order.shape)}")
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows:
        block = 1024
        _gather_kernel[(num_rows, triton.cdiv(num_cols, block))](
            x, order, out, x.stride(0), num_cols, BLOCK=block
        )
    return out


def rms_norm_fp8(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, *, group: int | None
) -> Fp8Rows:
    """rms_norm's output quantized in the same launch, per token (group None) or per
    128-group (group 128): what fp8_quant.quantize_per_token(rms_norm(...)), or
    quantize_per_token_group(rms_norm(...), 4), returns, bit for bit, without the 16-bit
    row's round trip through memory and the quantizer's launch."""
    out = Fp8Rows.empty(x.shape[0], x.shape[1], group, x.device)
    _launch(x, weight, eps, residual, out=out.codes, scale=out.scale, groups=group is not None)
    return out


def _launch(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None,
    *,
    out: Tensor,
    scale: Tensor | None,
    groups: bool = False,
    order: Tensor | None = None,
) -> None:
    """The kernel over out's rows (x's, or more: zero codes past them); scale: None
    (16-bit out), [rows, 1], or (groups) column-major [rows, groups]."""
    num_rows, num_cols = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows with unit stride")
    if order is not None and (tuple(order.shape) != (num_cols,) or scale is not None):
        raise ValueError(f"rms_norm's order is [{num_cols}] and makes 16-bit rows")
    if out.shape[0] == 0:
        return
    block = max(triton.next_power_of_2(num_cols), 128 if groups else 1)
    _rms_norm_kernel[(out.shape[0],)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        scale if scale is not None else out,
        order if order is not None else weight,
        num_rows,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        scale.stride(1) if scale is not None else 0,
        num_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        FP8=scale is not None,
        GROUPS=groups,
        ORDERED=order is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
