"""The FP8 product of a decode step's 1-16 rows through lmd._native's CUDA kernel
(native/kernels/fp8_rows.cu): mma.sync in fp16 on the tensor cores, two e4m3 codes made
an fp16 pair in one instruction, 16-byte loads of the weights, the next block of K loaded
while the current one is multiplied, K split over a CTA's warps and summed in warp order.
It reads the weights as quant/fp8.py holds them (no copy), per-channel or 128 x 128 block
scales, and x in bf16 or fp16 (bf16 taken as fp16, saturating at 65504: the kernel's
docstring).

`native_rows` returns None for what it does not take (more than 16 rows, N not a multiple
of 32, K not of 128, misaligned tensors, a GPU before sm_89, CPU tensors): the caller then
runs the Triton kernel (kernels/fp8.py). The launch goes on PyTorch's current stream, so a
decode step's CUDA graph captures it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmd._native import fp8_rows, fp8_rows_ready
from lmd.engine.turbo.kernels.native_kernels import NativeKernels, device_index
from lmd.engine.turbo.kernels.w4a16_rows import COLUMNS, MAX_ROWS, default_warps
from lmd.engine.turbo.quant.e4m3 import BLOCK as GROUP  # K's blocks, the scales' blocks

NATIVE_ROWS = True  # off: decode rows go to the Triton kernel (scripts' A/B runs)

_kernels = NativeKernels(fp8_rows_ready, "FP8 decode rows go to the Triton kernel")


def ready(device: torch.device) -> bool:
    """Is the kernel loaded on this CUDA device? Loads it on the first call (the driver
    compiles the PTX: call it before a CUDA graph is captured); logs once why not."""
    return _kernels.ready(device_index(device))


def native_rows(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    *,
    block_scaled: bool,
    warps: int | None = None,
) -> Tensor | None:
    """x [M, K] @ W^T (+ b) -> [M, N] in x's dtype through the native kernel, or None when
    it does not take the product or is not loaded on x's device. weight [N, K] e4m3,
    scale float32 [N] or [ceil(N/128), K/128] (block_scaled), bias [N] in x's dtype.
    `warps` overrides w4a16_rows.default_warps (the same registers' budget a CTA). Its
    loads need x's rows 16-byte aligned and the weight contiguous and 16-byte aligned."""
    m, k = x.shape
    n = weight.shape[0]
    takes = (
        NATIVE_ROWS
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and 1 <= m <= MAX_ROWS
        and n % COLUMNS == 0
        and k % GROUP == 0
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and weight.dtype == torch.float8_e4m3fn
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == 0
        and scale.dtype == torch.float32
        and scale.stride(-1) == 1
        and scale.dim() == (2 if block_scaled else 1)
        and (bias is None or (bias.is_contiguous() and bias.dtype == x.dtype))
    )
    if not takes:
        return None
    device = device_index(x.device)
    if not _kernels.ready(device):
        return None
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    warps = default_warps(m, n, k, _kernels.num_sms(device)) if warps is None else warps
    fp8_rows(
        device,
        x.data_ptr(),
        weight.data_ptr(),
        scale.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        x.stride(0),
        scale.stride(0) if block_scaled else 0,
        x.dtype == torch.bfloat16,
        warps,
        torch.cuda.current_stream(x.device).cuda_stream,
    )
    return y
