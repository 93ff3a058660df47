"""Launches to profile side by side (under `ncu`): Qwen3-8B's gate|up at one row
through vector_gemv with its norm and SiLU (the model's tiles, then the best of
gemv_bench.py's sweep), and a read-only stream of the same bytes
(scripts/read_bw_bench.py's kernel). Each launch twice, on its own copy of the weights.
CUDA only.

    ncu --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python3 scripts/gate_up_profile.py
"""

from __future__ import annotations

import torch

from lmd.engine.turbo import kernels
from scripts.read_bw_bench import read_call

N, K = 24576, 4096
TILES = [(4, 1024, 4, 3), (8, 1024, 4, 2)]  # the model's, gemv_bench's best (2026-11-30)


def main() -> None:
    dtype = torch.bfloat16
    x = torch.randn(1, K, device="cuda").to(dtype)
    residual = torch.randn(1, K, device="cuda").to(dtype)
    norm = kernels.Norm((1 + 0.1 * torch.randn(K, device="cuda")).to(dtype), 1e-6, residual)
    for tiles in TILES:
        for _ in range(2):
            w = (torch.randn(N, K, device="cuda") / K**0.5).to(dtype)
            kernels.vector_gemv(x, w, norm=norm, activation="silu", tiles=tiles)
    out = torch.empty(8 * torch.cuda.get_device_properties(0).multi_processor_count,
                      dtype=torch.int32, device="cuda")  # fmt: skip
    for _ in range(2):  # the same bytes as int32 words
        src = torch.randint(0, 2**31 - 1, (N * K // 2,), dtype=torch.int32, device="cuda")
        read_call(src, out, per_sm=8, block=2048, warps=4)[0]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
