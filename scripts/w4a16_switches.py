"""The W4A16 decode path's switches A/B'd in rotation, so that the machine's drift falls
on every setting alike (kernels/w4a16_rows.py: NATIVE_ROWS, the native CUDA kernels for
up to 32 rows, and WGMMA, Hopper's kernel for 33-64; kernels/w4a16.py: PACKED_NIBBLES,
and WIDE_N, where decode tiles go 128 columns wide). CUDA only.

    python3 scripts/w4a16_switches.py [MODEL_DIR] [--rounds 5] [--step-rounds 2]
        [--rows 1,16] [--settings NAME ...] [--warps] [--splits M]

First each Llama-3-8B product at each of `--rows` (w4a16_tiles.py's weights and graph
timing), every setting once a round for `--rounds` rounds, and cuBLAS on the 16-bit
weights as a reference: the median and the spread of each. With --warps, the rows
kernel's time at every warp count a CTA (M = 1); with --splits M, the wide kernel's (the
wgmma kernel's above 32 rows) at every split count of K (M rows). Then,
given a model directory, one W4A16 engine's batch-1 decode step (families_bench.py's
measure, graphs recaptured at each switch) for each setting, in turn, `--step-rounds`
times. Settings: the SWITCHES below (default: the native kernel and the Triton tiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from families_bench import batch1_step
from w4a16_tiles import L2_BYTES, SHAPES, time_us

from lmd.bench.offline import random_prompts, time_engine
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.turbo.kernels import w4a16 as w4a16_kernels
from lmd.engine.turbo.kernels import w4a16_rows
from lmd.engine.turbo.kernels.w4a16 import w4a16_matmul
from lmd.engine.turbo.quant.w4a16 import W4A16Weight

# name -> (NATIVE_ROWS, WGMMA, PACKED_NIBBLES, WIDE_N)
SWITCHES = {
    "native rows": (True, True, True, w4a16_kernels.WIDE_N),
    "native rows, no wgmma": (True, False, True, w4a16_kernels.WIDE_N),
    "packed, wide gate|up": (False, False, True, w4a16_kernels.WIDE_N),
    "packed, 64 wide": (False, False, True, 1 << 30),
    "one by one, wide gate|up": (False, False, False, w4a16_kernels.WIDE_N),
    "one by one, 64 wide": (False, False, False, 1 << 30),
}
DEFAULT_SETTINGS = ["native rows", "packed, wide gate|up"]


def setting(name: str) -> None:
    (w4a16_rows.NATIVE_ROWS, w4a16_rows.WGMMA, w4a16_kernels.PACKED_NIBBLES,
     w4a16_kernels.WIDE_N) = SWITCHES[name]  # fmt: skip


def copies_of(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Copies of one random weight's tensors, enough to be read from memory, not L2."""
    dense = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    weight = W4A16Weight.quantize(dense, 128)
    copies = max(1, min(64, L2_BYTES // weight.nbytes))
    return [(weight.qweight.clone(), weight.scales.clone(), weight.zeros.clone())
            for _ in range(copies)]  # fmt: skip


def warps_sweep() -> None:
    """The native kernel at M = 1 with each count of warps a CTA."""
    setting("native rows")
    for n, k in SHAPES:
        packed = copies_of(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        chosen = w4a16_rows.default_warps(1, n, k, sms)
        for warps in (2, 4, 8, 16):
            calls: list[Callable[[], object]] = [
                partial(w4a16_rows.native_rows, x, *p, 128, None, y, warps=warps) for p in packed
            ]
            print(json.dumps({"n": n, "k": k, "warps": warps, "default": warps == chosen,
                              "us": round(time_us(calls), 2)}), flush=True)  # fmt: skip


def splits_sweep(m: int) -> None:
    """The wide kernel (wgmma above 32 rows) at M = m with each count of splits of K."""
    setting("native rows")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in SHAPES:
        packed = copies_of(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        if m > w4a16_rows.WIDE_MAX_ROWS:  # the default is the most whose CTAs all fit
            most = chosen = w4a16_rows.wgmma_splits(n, k, w4a16_rows.wgmma_ctas(0))
        else:
            most, chosen = k // 128, w4a16_rows.default_splits(n, k, sms)
        for splits in sorted({s for s in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, chosen) if s <= most}):
            calls: list[Callable[[], object]] = [
                partial(w4a16_rows.native_rows, x, *p, 128, None, y, splits=splits) for p in packed
            ]
            print(json.dumps({"n": n, "k": k, "m": m, "splits": splits,
                              "default": splits == chosen, "us": round(time_us(calls), 2)}),
                  flush=True)  # fmt: skip


def products(rounds: int, rows: list[int], settings: list[str]) -> None:
    for (n, k), m in ((shape, m) for shape in SHAPES for m in rows):
        packed = copies_of(n, k)
        dense = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        denses = [dense] + [dense.clone() for _ in range(max(0, L2_BYTES // dense.nbytes - 1))]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        times: dict[str, list[float]] = {}
        for _ in range(rounds):
            times.setdefault("cuBLAS, 16-bit weights", []).append(
                time_us([partial(torch.nn.functional.linear, x, d) for d in denses])
            )
            for switch in settings:
                setting(switch)
                us = time_us([partial(w4a16_matmul, x, *p, 128) for p in packed])
                times.setdefault(switch, []).append(us)
        setting(next(iter(SWITCHES)))
        for name, values in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            print(json.dumps({"n": n, "k": k, "m": m, "setting": name,
                              "median_us": round(statistics.median(values), 2),
                              "min_us": round(min(values), 2), "max_us": round(max(values), 2)}),
                  flush=True)  # fmt: skip


def steps(model: Path, rounds: int, settings: list[str]) -> None:
    engine = Engine.build(
        model,
        EngineConfig(max_batch_size=1, quantization="w4a16"),
        device="cuda",
        dtype="bfloat16",
        backend="turbo",
    )
    time_engine(engine, random_prompts(1, 512, engine.backend.vocab_size, 1), 4)  # warm-up
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for switch in settings:
            setting(switch)
            engine.backend.capture_graphs(engine.pool.kv, 1)
            times.setdefault(switch, []).append(batch1_step(engine, 512, 256) * 1e3)
    setting(next(iter(SWITCHES)))
    for name, values in times.items():
        ms = [round(v, 3) for v in values]
        print(json.dumps({"model": model.name, "setting": name, "batch1_step_ms": ms}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path, nargs="?")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-rounds", type=int, default=2)
    parser.add_argument("--rows", default="1,16", help="rows of x, comma-separated")
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SWITCHES))
    parser.add_argument("--warps", action="store_true", help="the rows kernel's warps sweep")
    parser.add_argument("--splits", type=int, metavar="M", help="the wide kernel's splits sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("w4a16_switches.py needs a CUDA GPU")
    torch.manual_seed(0)
    if args.warps:
        warps_sweep()
    if args.splits:
        splits_sweep(args.splits)
    products(args.rounds, [int(m) for m in args.rows.split(",")], args.settings)
    if args.model is not None:
        steps(args.model, args.step_rounds, args.settings)


if __name__ == "__main__":
    main()
