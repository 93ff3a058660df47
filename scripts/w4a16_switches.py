"""The W4A16 decode path's switches A/B'd in rotation, so that the machine's drift falls
on every setting alike (kernels/w4a16.py: PACKED_NIBBLES, and WIDE_N, where decode
tiles go 128 columns wide). CUDA only.

    python3 scripts/w4a16_switches.py [MODEL_DIR] [--rounds 5] [--step-rounds 2]

First each Llama-3-8B product at M = 1 (w4a16_tiles.py's weights and graph timing), every
setting once a round for `--rounds` rounds: the median and the spread of each. Then,
given a model directory, one W4A16 engine's batch-1 decode step (families_bench.py's
measure, graphs recaptured at each switch) for each of the four switch settings, in
turn, `--step-rounds` times.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

import torch
from families_bench import batch1_step
from w4a16_tiles import L2_BYTES, SHAPES, time_us

from lmd.bench.offline import random_prompts, time_engine
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.turbo.kernels import w4a16 as w4a16_kernels
from lmd.engine.turbo.kernels.w4a16 import w4a16_matmul
from lmd.engine.turbo.quant.w4a16 import W4A16Weight

# name -> (PACKED_NIBBLES, WIDE_N)
SWITCHES = {
    "packed, wide gate|up": (True, w4a16_kernels.WIDE_N),
    "packed, 64 wide": (True, 1 << 30),
    "one by one, wide gate|up": (False, w4a16_kernels.WIDE_N),
    "one by one, 64 wide": (False, 1 << 30),
}


def setting(name: str) -> None:
    w4a16_kernels.PACKED_NIBBLES, w4a16_kernels.WIDE_N = SWITCHES[name]


def products(rounds: int) -> None:
    for n, k in SHAPES:
        dense = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        weight = W4A16Weight.quantize(dense, 128)
        copies = max(1, min(64, L2_BYTES // weight.nbytes))
        packed = [(weight.qweight.clone(), weight.scales.clone(), weight.zeros.clone())
                  for _ in range(copies)]  # fmt: skip
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        times: dict[str, list[float]] = {}
        for _ in range(rounds):
            for switch in SWITCHES:
                setting(switch)
                us = time_us([partial(w4a16_matmul, x, *p, 128) for p in packed])
                times.setdefault(switch, []).append(us)
        setting(next(iter(SWITCHES)))
        for name, values in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            print(json.dumps({"n": n, "k": k, "setting": name,
                              "median_us": round(statistics.median(values), 2),
                              "min_us": round(min(values), 2), "max_us": round(max(values), 2)}),
                  flush=True)  # fmt: skip


def steps(model: Path, rounds: int) -> None:
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
        for switch in SWITCHES:
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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("w4a16_switches.py needs a CUDA GPU")
    torch.manual_seed(0)
    products(args.rounds)
    if args.model is not None:
        steps(args.model, args.step_rounds)


if __name__ == "__main__":
    main()
