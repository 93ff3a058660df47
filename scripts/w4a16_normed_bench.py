"""A one-row 4-bit product with its RMSNorm: the rows kernel's normed launch against
rms_norm's launch then the product's (and, for gate|up, against those and SiLU's own
launch), timed as graph replays over copies of the weights past L2 (w4a16_tiles.py's
time_us). CUDA only; docs/benchmarks.md has the figures.

    python3 scripts/w4a16_normed_bench.py [--rounds 5] [--warps W]

Prints a JSON line a shape: the median microseconds of each way over `--rounds` rounds
(each way once a round, in turn) and the spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from functools import partial

import torch
from w4a16_tiles import L2_BYTES, time_us

from lmd.engine.turbo.kernels import rms_norm, silu_and_mul
from lmd.engine.turbo.kernels.w4a16_normed import native_normed
from lmd.engine.turbo.kernels.w4a16_rows import native_rows
from lmd.engine.turbo.quant.w4a16 import W4A16Weight

# name: (N, K, gated) at one row
SHAPES = {
    "llama3-8b qkv": (6144, 4096, False),
    "llama3-8b gate|up": (28672, 4096, True),
    "qwen3-30b-a3b qkv": (5120, 2048, False),
    "qwen3-8b gate|up": (24576, 4096, True),
}
EPS = 1e-6


def ways(n: int, k: int, gated: bool, warps: int | None) -> dict[str, list[Callable[[], object]]]:
    """Each way's calls, one a copy of the weight (enough copies to pass L2)."""
    dtype, cuda = torch.bfloat16, torch.device("cuda")
    copies = max(1, -(-L2_BYTES // (n * k // 2)))
    weights = [
        W4A16Weight.quantize(torch.randn(n, k, device=cuda, dtype=dtype) / k**0.5)
        for _ in range(copies)
    ]
    x = torch.randn(1, k, device=cuda, dtype=dtype)
    residual = torch.randn(1, k, device=cuda, dtype=dtype)
    gamma = torch.ones(k, device=cuda, dtype=dtype)
    summed = torch.empty_like(residual)
    out = torch.empty(1, n // 2 if gated else n, device=cuda, dtype=dtype)
    full = torch.empty(1, n, device=cuda, dtype=dtype)

    def normed(w: W4A16Weight) -> None:
        packed = (w.qweight, w.scales, w.zeros, w.group_size)
        args = (x, gamma, EPS, residual, summed, packed, None, out)
        assert native_normed(*args, gated=gated, warps=warps)

    def apart(w: W4A16Weight, *, silu_apart: bool) -> None:
        stream = residual.clone()  # the add leaves the inputs as they were
        h = rms_norm(x, gamma, EPS, stream)
        tensors = (w.qweight, w.scales, w.zeros, w.group_size)
        if gated and not silu_apart:
            assert native_rows(h, *tensors, None, out, gated=True)
            return
        assert native_rows(h, *tensors, None, full)
        if gated:
            silu_and_mul(full)

    result: dict[str, list[Callable[[], object]]] = {
        "normed": [partial(normed, w) for w in weights],
        "norm apart": [partial(apart, w, silu_apart=False) for w in weights],
    }
    if gated:
        result["norm and SiLU apart"] = [partial(apart, w, silu_apart=True) for w in weights]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--warps", type=int, default=None, help="the normed launch's (default: its own)"
    )
    args = parser.parse_args()
    for name, (n, k, gated) in SHAPES.items():
        calls = ways(n, k, gated, args.warps)
        times: dict[str, list[float]] = {way: [] for way in calls}
        for _ in range(args.rounds):
            for way, fns in calls.items():
                times[way].append(time_us(fns))
        print(
            json.dumps(
                {
                    "shape": name,
                    **{way: round(statistics.median(t), 2) for way, t in times.items()},
                    "spread": {way: round(max(t) - min(t), 2) for way, t in times.items()},
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
