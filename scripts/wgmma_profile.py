"""Launches to profile (under `ncu`): Hopper's W4A16 wgmma kernel on each of a
Llama-3-8B layer's four products at 64 rows (qkv, o, gate|up, down; the splits it
chooses), each twice, on copies of the weights (w4a16_switches.copies_of). CUDA only
(compute capability 9.0). scripts/gpu-wgmma-profile.sh runs it under ncu.

    ncu --kernel-name regex:lmd_w4a16_wgmma --section SpeedOfLight ... \\
        python3 scripts/wgmma_profile.py
"""

from __future__ import annotations

import torch
from w4a16_switches import copies_of
from w4a16_tiles import SHAPES

from lmd.engine.turbo.kernels import w4a16_rows

ROWS = 64


def main() -> None:
    if not w4a16_rows.ready(torch.device("cuda")) or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("needs lmd._native's kernels on a compute capability 9.0 GPU")
    for n, k in SHAPES:
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16)
        for packed in copies_of(n, k)[:2]:  # enough copies to be read from memory, not L2
            w4a16_rows.native_rows(x, *packed, 128, None, y)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
