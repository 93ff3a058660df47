"""Launches of the W4A16 64-row products to profile (under `ncu`): Llama-3-8B's gate|up
and o through native/kernels/w4a16_wgmma.cu (each in its default splits: gate|up one,
o six on an H200), each twice on its own weights, after one launch that loads the module. CUDA
only, an sm_90 GPU.

    ncu --clock-control none --set full -k regex:wgmma --launch-skip 1 \\
        -o wgmma python3 scripts/w4a16_wgmma_profile.py
"""

from __future__ import annotations

import torch

from lmd.engine.turbo.kernels.w4a16_rows import native_rows
from lmd.engine.turbo.quant.w4a16 import W4A16Weight

SHAPES = [(28672, 4096), (4096, 4096)]  # gate|up, o
ROWS = 64


def main() -> None:
    dtype = torch.bfloat16
    for n, k in SHAPES:
        x = torch.randn(ROWS, k, device="cuda").to(dtype)
        y = torch.empty(ROWS, n, device="cuda", dtype=dtype)
        for _ in range(2):
            w = W4A16Weight.quantize((torch.randn(n, k, device="cuda") / k**0.5).to(dtype), 128)
            assert native_rows(x, w.qweight, w.scales, w.zeros, 128, None, y)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
