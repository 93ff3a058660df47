"""Where an engine decode step's time goes, phase by phase (a GPU-machine tool).

    python3 scripts/step_profile.py MODEL_DIR [--batch 512] [--input-len 512] [--steps 30]
        [--quantization fp8|w4a16] [--kv-cache-dtype int8|fp8] [--kernels K]

Builds the engine as `lmd-bench offline` does, prefills `--batch` random prompts, then
runs `--steps` decode steps with each phase wrapped: the decode scheduler, packing the
batch (ForwardBatch.pack), the backend's forward, the sampler, reading the tokens back,
the scheduler's postprocess, the events. A CUDA synchronize closes each phase, so a phase's
GPU work counts in it (the engine does not overlap them today either: reading the sampled
tokens waits for the step). Prints the median ms of each phase and of the whole step;
with `--kernels K`, then the K costliest kernels of five more steps under torch.profiler.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tp_step import kernel_table, print_kernels  # scripts/ is this script's import path

from lmd.bench.offline import random_prompts
from lmd.engine import engine as engine_module
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.sequence import SamplingParams, Sequence

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        TIMES[name].append(time.perf_counter() - start)
        return out

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kernels", type=int, default=0, help="print the K costliest kernels")
    args = p.parse_args()
    config = EngineConfig(
        max_batch_size=args.batch,
        max_prefill_token_num=8192,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = Engine.build(args.model, config, device="cuda", backend="turbo")
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    prompts = random_prompts(args.batch, args.input_len, engine.backend.vocab_size, 0)
    for i, prompt in enumerate(prompts):
        engine.add(Sequence(f"p{i}", prompt, params))
    while engine.prefill.has_work:
        engine.step()
    engine.step()  # the first decode step (graph capture, if any, happens here)
    engine.decode.schedule = timed("schedule", engine.decode.schedule)
    engine.decode.postprocess = timed("postprocess", engine.decode.postprocess)
    engine.backend.forward = timed("forward", engine.backend.forward)
    engine.sampler.sample = timed("sample", engine.sampler.sample)
    engine._events = timed("events", engine._events)
    pack = engine_module.ForwardBatch.pack
    engine_module.ForwardBatch.pack = timed("pack", pack)  # type: ignore[method-assign]
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        TIMES["step"].append(time.perf_counter() - start)
    label = f"quantization={args.quantization} kv={args.kv_cache_dtype}"
    print(f"{args.model.name} {label}, batch {args.batch}, context ~{args.input_len}: median ms")
    for name, values in TIMES.items():
        print(f"  {name:12s} {statistics.median(values) * 1e3:8.3f}", flush=True)
    if args.kernels:
        step_ms = statistics.median(TIMES["step"]) * 1e3
        print_kernels(kernel_table(lambda n: engine.step(), 5), args.kernels, step_ms)


if __name__ == "__main__":
    main()
