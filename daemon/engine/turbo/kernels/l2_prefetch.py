"""Weights asked into L2 ahead of the product that reads them: a small-batch decode step
streams every weight from HBM once, but between the qkv and o products come rotary,
attention and its merge, kernels that read little (a layer's KV of one sequence: ~2 MB)
while the memory bus idles. The o product's weights (32 MB on an 8B shape, within an
H100's or H200's 50 MB L2) are asked for at the start of that gap, so that o reads them
from L2.

Each lane asks for one CHUNK of the bytes with Hopper's `cp.async.bulk.prefetch.L2`: a
request the copy engine carries out on its own, so the launch ends once the requests are
issued and the kernels after it run while the bytes arrive. A hint only: no result
depends on it, and it does nothing where it cannot run (the interpreter, a GPU before
sm_90).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.common import interpreting

CHUNK = 16384  # bytes a lane asks for (a multiple of 16)
LANES = 32  # a program: one warp


@triton.jit
def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    start = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK)
    # inline PTX takes no mask: lanes past the end ask for the last 16 bytes again
    start = tl.where(size > 0, start, nbytes - 16)
    size = tl.where(size > 0, size, 16).to(tl.int32)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [ptr + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def supported(t: Tensor) -> bool:
    """Whether prefetch_l2 does anything for `t`: a contiguous CUDA tensor of whole
    16-byte units on sm_90 or later, compiled (not interpreted)."""
    if interpreting() or not t.is_cuda or not t.is_contiguous():
        return False
    nbytes = t.numel() * t.element_size()
    aligned = t.data_ptr() % 16 == 0 and nbytes % 16 == 0 and nbytes > 0
    return aligned and _hopper_or_later(t.device.index or 0)


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def prefetch_l2(*tensors: Tensor, chunk: int = CHUNK) -> None:
    """Ask L2 for each tensor's bytes (those `supported` takes; the rest are skipped)."""
    if chunk <= 0 or chunk % 16:
        raise ValueError(f"chunk must be a positive multiple of 16 bytes, got {chunk}")
    for t in tensors:
        if not supported(t):
            continue
        nbytes = t.numel() * t.element_size()
        lanes = triton.cdiv(nbytes, chunk)
        grid = (triton.cdiv(lanes, LANES),)
        _prefetch_kernel[grid](t.view(-1).view(torch.uint8), nbytes, chunk, LANES, num_warps=1)
