"""What gathering a product's inputs into an act-order weight's packed order costs, a
call, inside a CUDA graph (docs/benchmarks.md, "Act-order GPTQ checkpoints").

    python3 scripts/gather_bench.py [--rows 1,64] [--width 4096] [--calls 96]

Each way is captured as `calls` back-to-back calls in one graph, replayed 20 times; the
median replay over `calls` is a call's cost, its launch boundary included. A copy of the
same rows (`clone`) is the reference for a launch that moves those bytes; qkv's W4A16 product
(6144 outputs) timed in order and in act order gives the gather's cost inside a product.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch

from lmd.engine.turbo import kernels
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from scripts.w4a16_tiles import time_us


def ways_for(x: torch.Tensor, perm: torch.Tensor) -> dict[str, Callable[[], object]]:
    perm32 = perm.to(torch.int32)
    return {
        "clone": x.clone,
        "index_select": lambda: x.index_select(1, perm),
        "index_select_int32": lambda: x.index_select(1, perm32),
        "getitem": lambda: x[:, perm],
        "gather_columns": lambda: kernels.gather_columns(x, perm),
    }


def products_for(x: torch.Tensor, perm: torch.Tensor) -> dict[str, Callable[[], object]]:
    """qkv's W4A16 product (6144 x K) of x, in order and in act order."""
    dense = torch.randn(6144, x.shape[1], device=x.device, dtype=x.dtype)
    plain = W4A16Weight.quantize(dense)
    ordered = dataclasses.replace(plain, perm=perm)
    return {"product": lambda: plain.matmul(x), "product_act_order": lambda: ordered.matmul(x)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=96)
    args = parser.parse_args()
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, args.width, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(args.width, device="cuda")
        for name, fn in (ways_for(x, perm) | products_for(x, perm)).items():
            us = time_us([fn] * args.calls, replays=20)
            print(json.dumps({"rows": rows, "width": args.width, "way": name,
                              "us_a_call": round(us, 2)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
