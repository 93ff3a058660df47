"""Launches to profile (under `ncu`): Hopper's W4A16 wgmma kernel on each of a
Llama-3-8B layer's four products at 64 rows (qkv, o, gate|up, down; the splits it
chooses), each twice, on its own copy of the weights. CUDA only (compute capability
9.0). scripts/gpu-wgmma-profile.sh runs it under ncu.

    ncu --kernel-name regex:lmd_w4a16_wgmma --section SpeedOfLight ... \\
        python3 scripts/wgmma_profile.py
"""

from __future__ import annotations

import torch
from w4a16_tiles import SHAPES

from lmd.engine.turbo.kernels import w4a16_rows
from lmd.engine.turbo.quant.w4a16 import W4A16Weight

ROWS = 64


def main() -> None:
    if not w4a16_rows.ready(torch.device("cuda")) or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("needs lmd._native's kernels on a compute capability 9.0 GPU")
    for n, k in SHAPES:
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            dense = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
            weight = W4A16Weight.quantize(dense, 128)
            del dense
            w4a16_rows.native_rows(x, weight.qweight, weight.scales, weight.zeros, 128, None, y)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
