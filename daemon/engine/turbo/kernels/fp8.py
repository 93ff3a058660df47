"""FP8 (e4m3) matrix products: y = x @ W^T (+ b) with W stored in float8_e4m3fn.

W carries float32 scales sw, per output channel ([N]) or per 128x128 block ([ceil(N/128),
ceil(K/128)], DeepSeek-V3's and Qwen3-FP8's `weight_scale_inv`: W = W_fp8 * sw[n/128,
k/128]). Past SMALL_ROWS rows, x is quantized per token, x ~= x_fp8 * sx with sx = row
absmax / 448 (e4m3's largest value), over the whole row ([M, 1]) or each 128-group
([M, K/128], for block weights), and

    y[m, n] = sum over K blocks j of sx[m, j] * sw[n, j] * (x_fp8[m, j] . W_fp8[n, j])

runs on fp8 tensor cores, summed in float32: through torch._scaled_mm (cuBLAS) with
row-wise or 1x128 x 128x128 block scales where it takes them (Hopper), else through the
Triton kernel here, which scales each 128-deep step's dot before adding it to its float32
accumulator. Up to SMALL_ROWS rows (decode: memory-bound) x is not quantized: the native
kernel (kernels/fp8_rows.py), or else the Triton kernel here, which reads x as it is and
widens each W tile to x's dtype. The activations' quantizers are kernels/fp8_quant.py's;
a product also takes codes the kernel before it made (the RMSNorm's or the activation's:
`fp8_matmul_rows` per token, `fp8_matmul_groups` per group). Nothing here syncs with the
host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.fp8_quant import quantize_per_token, quantize_per_token_group
from lmd.engine.turbo.kernels.fp8_rows import native_rows
from lmd.engine.turbo.quant.e4m3 import BLOCK as GROUP  # K groups, and weight blocks along N

Tiles = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
SMALL_ROWS = 16  # up to this many rows, x stays 16-bit (fp8_matmul)
# cuBLAS's fp8 sums without its periodic promotion to float32 (torch._scaled_mm's
# use_fast_accum; CUTLASS's FP8FastAccum schedules, what vLLM's Hopper fp8 GEMMs run) for
# per-channel products: 6-15% faster at 8192 rows on an H200, the error against float32
# 1.7e-3 -> 2.1e-3 of the norm at K = 4096, 3.3e-3 at 14336 (scripts/fp8_bench.py
# --fast-accum; docs/benchmarks.md).
FAST_ACCUM = True


@triton.jit
def _fp8_gemm_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    b_ptr,
    c_ptr,
    m,
    n,
    k,
    stride_a,
    stride_as,
    stride_w,
    stride_ws,
    stride_c,
    A_FP8: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """c = (a * sa) @ (w * sw)^T. sw: [N] per channel, or [N/128, K/128] at stride_ws
    per block row (BLOCK_SCALED). A_FP8: a is fp8 with sa [M] per token, or [M, K/128] at
    stride_as per group when BLOCK_SCALED (then BLOCK_K = 128); else a is 16-bit (no sa)
    and each W tile is widened to a's dtype (BLOCK_SCALED: times its block scales, and
    BLOCK_N divides 128), the weight-only path of small batches."""
    # Programs go down GROUP_M row tiles before moving right, so that a band of W's
    # columns is read from HBM once for GROUP_M row tiles (the rest hits L2).
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    band_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_m
    pid_n = (pid % band) // band_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows and columns read row/column 0 (cheaper than masks, never stored).
    safe_rows = tl.where(rows < m, rows, 0).to(tl.int64)
    safe_cols = tl.where(cols < n, cols, 0).to(tl.int64)
    n_block = pid_n * BLOCK_N // GROUP
    if not BLOCK_SCALED:
        sw = tl.load(w_scale_ptr + safe_cols)  # [BLOCK_N]
        if A_FP8:
            sa = tl.load(a_scale_ptr + safe_rows)  # [BLOCK_M]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + safe_rows[:, None] * stride_a + ks[None, :], mask=ks[None, :] < k, other=0.0
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + safe_cols[None, :] * stride_w + ks[:, None], mask=ks[:, None] < k, other=0.0
        )  # [BLOCK_K, BLOCK_N] fp8, K-major as fp8 tensor-core dots want it
        if A_FP8:  # each step scaled: the fp8 tensor cores' own sums are short of float32
            if BLOCK_SCALED:
                j = k0 // BLOCK_K
                sw = tl.load(w_scale_ptr + (safe_cols // GROUP) * stride_ws + j)
                sa = tl.load(a_scale_ptr + j * stride_as + safe_rows)
            acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
        elif BLOCK_SCALED:  # W widened with its blocks' scales (all its columns in one block)
            sk = tl.load(w_scale_ptr + n_block * stride_ws + ks // GROUP, mask=ks < k, other=0.0)
            acc = tl.dot(a, (w.to(tl.float32) * sk[:, None]).to(a.dtype), acc)
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    if not A_FP8 and not BLOCK_SCALED:
        acc *= sw[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + safe_cols).to(tl.float32)[None, :]
    tl.store(
        c_ptr + rows.to(tl.int64)[:, None] * stride_c + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=(rows[:, None] < m) & (cols[None, :] < n),
    )


def default_tiles(num_rows: int, n: int, a_fp8: bool, block_scaled: bool) -> Tiles:
    """BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: the fastest of sweeps on an H100 at
    Llama-3-8B's shapes. 16-bit a (decode's few rows): narrow, deep tiles, so that many
    programs stream W at once. fp8 a: BLOCK_K is the 128 group."""
    if not a_fp8:
        if n >= 16384:
            return (16, 64, 512, 4, 3)
        return (16, 32, 1024, 4, 3) if n <= 4096 else (16, 64 if block_scaled else 32, 512, 4, 3)
    if num_rows <= 32:
        return (max(16, triton.next_power_of_2(num_rows)), 64, 128, 4, 4)
    return (64, 128, 128, 4, 4)


def fp8_gemm(
    a: Tensor,
    a_scale: Tensor | None,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    *,
    out_dtype: torch.dtype,
    block_scaled: bool,
    tiles: Tiles | None = None,
) -> Tensor:
    """The Triton GEMM -> [M, N] in out_dtype. weight: [N, K] fp8 with weight_scale [N],
    or [ceil(N/128), ceil(K/128)] when block_scaled; bias: [N]. a: [M, K] fp8 with a_scale
    [M] (per channel) or [M, ceil(K/128)] (block_scaled, unit row stride), or a: 16-bit
    with a_scale None (W widened to a's dtype: no activation quantization)."""
    num_rows, k = a.shape
    n = weight.shape[0]
    if weight.shape[1] != k or a.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"fp8_gemm: a {tuple(a.shape)} against weight {tuple(weight.shape)}")
    a_fp8 = a_scale is not None
    tiles = tiles or default_tiles(num_rows, n, a_fp8, block_scaled)
    block_m, block_n, block_k, num_warps, num_stages = tiles
    stride_as, stride_ws = 0, 0
    if block_scaled:
        if weight_scale.stride(1) != 1 or (block_k != GROUP if a_fp8 else GROUP % block_n):
            raise ValueError("block-scaled fp8_gemm: BLOCK_K 128 (fp8 a) or BLOCK_N | 128")
        stride_ws = weight_scale.stride(0)
        if a_scale is not None:
            if a_scale.stride(0) != 1:
                raise ValueError("block-scaled fp8_gemm takes column-major activation scales")
            stride_as = a_scale.stride(1)
    out = torch.empty(num_rows, n, dtype=out_dtype, device=a.device)
    if num_rows == 0:
        return out
    grid = (triton.cdiv(num_rows, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](
        a, a_scale if a_scale is not None else weight_scale, weight, weight_scale,
        bias if bias is not None else weight_scale, out, num_rows, n, k,
        a.stride(0), stride_as, weight.stride(0), stride_ws, out.stride(0),
        A_FP8=a_fp8, BLOCK_SCALED=block_scaled, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP=GROUP, GROUP_M=8, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def scaled_mm_fits(weight: Tensor, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes this with row-wise scales: Hopper or newer, bf16 or
    fp16 out, K and N multiples of 16 (cuBLASLt's fp8 alignment; M is free). Elsewhere
    (Ada's 8.9, odd shapes, the CPU interpreter) the Triton kernel runs."""
    n, k = weight.shape
    if not (weight.is_cuda and out_dtype in (torch.bfloat16, torch.float16)):
        return False
    return k % 16 == 0 and n % 16 == 0 and torch.cuda.get_device_capability(weight.device) >= (9, 0)


def scaled_mm_blocks_fit(weight: Tensor, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes 1x128 activation and 128x128 weight scales here:
    cuBLAS 12.9+ has that recipe on Hopper only, for bf16 out, with 16-byte aligned scale
    columns (K a multiple of 512, N of 128). Tried once per device, outside graph capture
    (torch 2.11 takes it; older ones may not)."""
    n, k = weight.shape
    if not (weight.is_cuda and out_dtype == torch.bfloat16 and k % 512 == 0 and n % GROUP == 0):
        return False
    index = weight.device.index
    index = index if index is not None else torch.cuda.current_device()
    if index not in _CUBLAS_BLOCKS:
        if torch.cuda.is_current_stream_capturing():
            return False  # the Triton kernel runs this once
        _CUBLAS_BLOCKS[index] = _try_cublas_blocks(torch.device("cuda", index))
    return _CUBLAS_BLOCKS[index]


_CUBLAS_BLOCKS: dict[int, bool] = {}  # device index -> torch._scaled_mm takes block scales


def _try_cublas_blocks(device: torch.device) -> bool:
    if torch.cuda.get_device_capability(device)[0] != 9:  # cuBLAS: Hopper only
        return False
    xq, xs = quantize_per_token_group(torch.ones(3, 512, dtype=torch.bfloat16, device=device), 4)
    w = torch.ones(128, 512, dtype=torch.float8_e4m3fn, device=device)
    try:
        y = scaled_mm_blocks(xq, xs, w, torch.ones(1, 4, device=device), torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return bool((y[:3] == 512).all() and (y[3] == 0).all())


def scaled_mm_blocks(
    xq: Tensor, xs: Tensor, weight: Tensor, weight_scale: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """torch._scaled_mm with xs [M, K/128] (stride (1, M'), from quantize_per_token_group)
    and weight_scale [N/128, K/128]: cuBLAS's DeepSeek recipe (1x128 x 128x128)."""
    return torch._scaled_mm(
        xq, weight.t(), scale_a=xs, scale_b=weight_scale.t(), out_dtype=out_dtype
    )


def scaled_mm_rows(
    xq: Tensor, xs: Tensor, weight: Tensor, weight_scale: Tensor, *, bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """torch._scaled_mm with row-wise float32 scales xs [M, 1] and weight_scale [N] (as
    [1, N]); W^T is column-major as cuBLASLt's fp8 kernels want; bias in out_dtype."""
    scale_b = weight_scale.view(1, -1)
    return torch._scaled_mm(
        xq, weight.t(), scale_a=xs, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
        use_fast_accum=FAST_ACCUM,
    )  # fmt: skip


def fp8_matmul(
    x: Tensor,
    weight_fp8: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    block_size: tuple[int, int] | None = None,
) -> Tensor:
    """x: [M, K] bf16/fp16; weight_fp8: [N, K] float8_e4m3fn; weight_scale: [N] float32
    (block_size None) or [ceil(N/128), ceil(K/128)] (block_size (128, 128)); bias: [N] in
    x's dtype -> [M, N] in x's dtype.

    Up to SMALL_ROWS rows (decode, memory-bound: no quantizer launch): the native kernel
    (kernels/fp8_rows.py) where it takes the product, else the Triton kernel on 16-bit x,
    W widened as it streams. More rows: x quantized per token (per 128-group
    for blocks), then cuBLAS through torch._scaled_mm where it fits, else the Triton kernel."""
    block_scaled = block_size is not None
    if block_size is not None and tuple(block_size) != (GROUP, GROUP):
        raise ValueError(f"fp8_matmul takes 128x128 weight blocks, not {block_size}")
    if x.shape[0] <= SMALL_ROWS:
        y = native_rows(x, weight_fp8, weight_scale, bias, block_scaled=block_scaled)
        if y is not None:
            return y
        return fp8_gemm(
            x, None, weight_fp8, weight_scale, bias, out_dtype=x.dtype, block_scaled=block_scaled
        )
    if not block_scaled:
        xq, xs = quantize_per_token(x)
        return fp8_matmul_rows(xq, xs, weight_fp8, weight_scale, bias, out_dtype=x.dtype)
    cublas = scaled_mm_blocks_fit(weight_fp8, x.dtype)
    xq, xs = quantize_per_token_group(x, 4 if cublas else 1)
    return fp8_matmul_groups(xq, xs, len(x), weight_fp8, weight_scale, bias, out_dtype=x.dtype)


def fp8_matmul_groups(  # noqa: PLR0917  # the codes' and the weight's tensors
    xq: Tensor,
    xs: Tensor,
    num_rows: int,
    weight_fp8: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    *,
    out_dtype: torch.dtype,
) -> Tensor:
    """x quantized per 128-group (xq [M', K] e4m3, xs [M', K/128] column-major:
    quantize_per_token_group's, or rms_norm_fp8's and silu_and_mul_fp8's with group 128;
    rows from num_rows on are padding) by a block-scaled weight -> [num_rows, N]: cuBLAS
    where it fits (M' a multiple of 4), else the Triton kernel."""
    if xq.shape[0] % 4 == 0 and scaled_mm_blocks_fit(weight_fp8, out_dtype):
        y = scaled_mm_blocks(xq, xs, weight_fp8, weight_scale, out_dtype)
    else:
        y = fp8_gemm(xq, xs, weight_fp8, weight_scale, out_dtype=out_dtype, block_scaled=True)
    y = y[:num_rows]
    return y if bias is None else y.add_(bias)


def fp8_matmul_rows(
    xq: Tensor,
    xs: Tensor,
    weight_fp8: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    *,
    out_dtype: torch.dtype,
) -> Tensor:
    """x quantized per token (xq [M, K] e4m3, xs [M, 1] float32: quantize_per_token's, or
    rms_norm_fp8's and silu_and_mul_fp8's) by a per-channel weight ([N, K] e4m3, scale
    [N] float32) -> [M, N] in out_dtype: cuBLAS where it fits, else the Triton kernel."""
    if scaled_mm_fits(weight_fp8, out_dtype):
        return scaled_mm_rows(xq, xs, weight_fp8, weight_scale, bias=bias, out_dtype=out_dtype)
    return fp8_gemm(
        xq, xs.view(-1), weight_fp8, weight_scale, bias, out_dtype=out_dtype, block_scaled=False
    )
