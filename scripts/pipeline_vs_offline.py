"""lmd.pipeline against `lmd-bench offline` on one workload: output tokens per second of each.

    python3 scripts/pipeline_vs_offline.py --model DIR [--batch 64] [--input-len 512]
        [--output-len 256] [--backend auto|torch|turbo] [--repeats 3] [--iterations 5]
        [--out FILE]

Both sides run the same Engine on the same prompts: `--batch` random-token prompts of
exactly --input-len tokens (lmd.bench.offline.random_prompts, same seed), --output-len
tokens each with ignore_eos, greedy, max_batch_size = --batch, 64-token blocks, 8192
prefill tokens per step, the same KV pool fraction; each side warms up first (one prompt,
4 tokens), as `lmd-bench offline` does. The offline side builds the engine as `lmd-bench
offline` does and times it with its own `time_engine`; the pipeline side times one
blocking call, `pipe(prompts, gen_config=...)`, which also makes the text (what a user of
the pipeline gets) when the model has a tokenizer. Each side runs in a fresh process,
alternating, --repeats times, and times --iterations runs in it (a SmolLM2-sized run takes
~0.4 s on an H100: one is too short to see 5%); a run's figure is the median of its
iterations, the summary's the median of its runs, and the ratio pipeline / offline
(issue 25 asks for >= 0.95 at batch 64 on a GPU). lmd.bench
imports lmd._native: build it first (`python3 setup.py build_ext --inplace`), as
scripts/gpu-pipeline.sh does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

SIDES = ("offline", "pipeline")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backend", choices=("auto", "torch", "turbo"), default="auto")
    p.add_argument("--cache-max-entry-count", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per side")
    p.add_argument("--iterations", type=int, default=5, help="timed runs per process")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one run, in a child
    p.add_argument("--out", type=Path, help="also write every run and the summary as JSON")
    args = p.parse_args()
    if args.side:
        print(json.dumps(run_side(args)))
        return
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for side in SIDES:
            runs.append(child(side, sys.argv[1:]))
            print(json.dumps(runs[-1]), flush=True)
    summary = summarize(runs)
    print(
        f"batch {args.batch}, {args.input_len} in / {args.output_len} out, "
        f"{summary['backends']}: offline {summary['offline']:,.1f} output tok/s, "
        f"pipeline {summary['pipeline']:,.1f} (medians of {args.repeats}); "
        f"pipeline / offline = {summary['ratio']:.3f}"
    )
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


def child(side: str, argv: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, *argv, "--side", side],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"the {side} run failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    median = {
        side: statistics.median(r["output_tokens_per_s"] for r in runs if r["side"] == side)
        for side in SIDES
    }
    backends = sorted({f"{r['side']}: {r['backend']} {r['dtype']}" for r in runs})
    return {**median, "ratio": median["pipeline"] / median["offline"], "backends": backends}


def run_side(args: argparse.Namespace) -> dict[str, Any]:
    """One side in this process: a warm-up, then --iterations timed runs (the median).
    Also where the time went: the engine's steps (their sum and median) and the garbage
    collector's passes, so that a gap can be told apart as slower steps or time between."""
    import gc

    from lmd.bench.offline import random_prompts
    from lmd.engine.engine import Engine

    step_s: list[float] = []
    step = Engine.step

    def timed_step(self: Engine) -> Any:
        t0 = time.perf_counter()
        try:
            return step(self)
        finally:
            step_s.append(time.perf_counter() - t0)

    Engine.step = timed_step  # type: ignore[method-assign]

    if args.side == "offline":
        from lmd.bench.offline import time_engine
        from lmd.engine.config import EngineConfig
        from lmd.engine.model_source import resolve_model

        # What `lmd-bench offline` builds for these flags (lmd/bench/offline.py, run).
        config = EngineConfig(
            block_size=64,
            max_batch_size=args.batch,
            max_prefill_token_num=8192,
            cache_max_entry_count=args.cache_max_entry_count,
        )
        model = resolve_model(args.model).path
        engine = Engine.build(
            model, config, device=args.device, dtype=args.dtype, backend=args.backend
        )
        backend = engine.backend
        prompts = random_prompts(args.batch, args.input_len, backend.vocab_size, 0)
        time_engine(engine, prompts[:1], 4)  # warm-up
        step_s.clear()
        gc_before = [g["collections"] for g in gc.get_stats()]
        seconds = [time_engine(engine, prompts, args.output_len)[0] for _ in range(args.iterations)]
        text = False
    else:
        pipe = make_pipeline(args)
        backend = pipe.backend
        prompts = random_prompts(args.batch, args.input_len, backend.vocab_size, 0)
        time_pipeline(pipe, prompts[:1], 4)  # warm-up
        step_s.clear()
        gc_before = [g["collections"] for g in gc.get_stats()]
        seconds = [time_pipeline(pipe, prompts, args.output_len) for _ in range(args.iterations)]
        text = pipe.tokenizer is not None  # it detokenized as it ran
        pipe.close()
    median = statistics.median(seconds)
    return {
        "side": args.side,
        "backend": backend.name,
        "dtype": str(backend.dtype).removeprefix("torch."),
        "text": text,
        "seconds": [round(t, 4) for t in seconds],
        "output_tokens_per_s": round(args.batch * args.output_len / median, 1),
        "steps": len(step_s),
        "step_s_sum": round(sum(step_s), 4),
        "step_ms_median": round(1e3 * statistics.median(step_s), 4),
        "outside_steps_s": round(sum(seconds) - sum(step_s), 4),
        "gc_collections": [
            g["collections"] - b for g, b in zip(gc.get_stats(), gc_before, strict=True)
        ],
    }


def make_pipeline(args: argparse.Namespace) -> Any:
    from lmd import PytorchEngineConfig, TurbomindEngineConfig, pipeline

    engine_args: dict[str, Any] = {
        "dtype": args.dtype,
        "max_batch_size": args.batch,
        "max_prefill_token_num": 8192,
        "cache_max_entry_count": args.cache_max_entry_count,
        "device_type": args.device,
    }
    if args.backend == "torch":
        settings: Any = PytorchEngineConfig(block_size=64, **engine_args)
    else:  # turbo where it runs (an explicit turbo that cannot would fail the offline side)
        settings = TurbomindEngineConfig(cache_block_seq_len=64, **engine_args)
    return pipeline(args.model, backend_config=settings)


def time_pipeline(pipe: Any, prompts: list[list[int]], output_len: int) -> float:
    """Seconds of one blocking call, as `time_engine` times the engine's steps."""
    from lmd import GenerationConfig

    gen = GenerationConfig(max_new_tokens=output_len, ignore_eos=True)
    sync(pipe.backend.device)
    start = time.perf_counter()
    responses = pipe(prompts, gen)
    sync(pipe.backend.device)
    seconds = time.perf_counter() - start
    generated = sum(r.generate_token_len for r in responses)
    if generated != len(prompts) * output_len:
        raise RuntimeError(f"the pipeline generated {generated} tokens")
    return seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
