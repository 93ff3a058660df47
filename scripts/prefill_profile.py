"""Where a prefill step's time goes, kernel by kernel (a GPU-machine tool).

    python3 scripts/prefill_profile.py MODEL_DIR [--prompts 16] [--input-len 512]
        [--quantization fp8|w4a16] [--kv-cache-dtype int8|fp8] [--top 15]

Builds the engine as `lmd-bench offline` does (turbo, bf16; `--device cpu`: torch,
float32, CPU time, a dry run of the script) and runs rounds of one
prefill step each: `--prompts` random prompts of `--input-len` tokens, one output token
(max_tokens 1, so each round is the one step). Two rounds warm up, five are timed (ms a
step, tokens a second), three run under torch.profiler, which prints the `--top` kernels
by device time a step (us, launches a step, share of the step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lmd.bench.offline import random_prompts
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.sequence import SamplingParams, Sequence

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run (torch backend)")
    args = parser.parse_args()
    tokens = args.prompts * args.input_len
    config = EngineConfig(
        max_batch_size=args.prompts,
        max_prefill_token_num=tokens,
        cache_max_entry_count=0.5,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    on_cuda = args.device.startswith("cuda")
    engine = Engine.build(
        args.model,
        config,
        device=args.device,
        dtype="bfloat16" if on_cuda else "float32",
        backend="turbo" if on_cuda else "torch",
    )
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    vocab = engine.backend.vocab_size
    rounds = iter(range(1000))

    def prefill_round() -> None:
        seed = next(rounds)
        for i, prompt in enumerate(random_prompts(args.prompts, args.input_len, vocab, seed)):
            engine.add(Sequence(f"{seed}-{i}", prompt, ONE_TOKEN))
        steps = 0
        while engine.has_work:
            engine.step()
            steps += 1
        if steps != 1:
            raise RuntimeError(f"a round took {steps} steps, not one prefill step")

    for _ in range(2):
        prefill_round()
    times = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        prefill_round()
        sync()
        times.append(time.perf_counter() - start)
    step_ms = statistics.median(times) * 1e3
    label = f"quantization={args.quantization} kv={args.kv_cache_dtype}"
    print(f"{label}: prefill step of {tokens} tokens {step_ms:.1f} ms, "
          f"{tokens / step_ms * 1e3:,.0f} tok/s", flush=True)  # fmt: skip

    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(3):
            prefill_round()
        sync()
    field = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    rows = [
        (event.key, getattr(event, field) / 3, event.count / 3)
        for event in prof.key_averages()
        if getattr(event, field, 0) > 0
    ]
    rows.sort(key=lambda row: -row[1])
    total = sum(us for _, us, _ in rows)
    for name, us, count in rows[: args.top]:
        print(f"  {us:9.1f} us  x{count:5.1f}  {100 * us / total:4.1f}%  {name[:80]}")
    print(f"  kernels {total / 1e3:.1f} ms a step, step {step_ms:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
