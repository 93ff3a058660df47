"""Where a prefill step's time goes, kernel by kernel (a GPU-machine tool).

    python3 scripts/prefill_profile.py MODEL_DIR [--prompts 16] [--input-len 512]
        [--quantization fp8|w4a16] [--kv-cache-dtype int8|fp8] [--top 15] [--no-fp8-codes]
        [--separate-moe-activation]

Builds the engine as `lmd-bench offline` does (turbo, bf16) and runs rounds of one
prefill step each: `--prompts` random prompts of `--input-len` tokens, one output token
(max_tokens 1, so each round is the one step). Two rounds warm up, five are timed (ms a
step, tokens a second), three run under torch.profiler (tp_step.py's kernel table: the
`--top` kernels by device time a step, launches a step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tp_step import kernel_table, print_kernels  # scripts/ is this script's import path

from lmd.bench.offline import random_prompts
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.sequence import SamplingParams, Sequence
from lmd.engine.turbo.kernels import moe

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--no-fp8-codes", action="store_true", help="TurboModel.fp8_codes off")
    parser.add_argument(
        "--separate-moe-activation",
        action="store_true",
        help="experts: SiLU-and-multiply in a kernel of its own (moe.GATED_GEMM off)",
    )
    args = parser.parse_args()
    moe.GATED_GEMM = not args.separate_moe_activation
    tokens = args.prompts * args.input_len
    config = EngineConfig(
        max_batch_size=args.prompts,
        max_prefill_token_num=tokens,
        cache_max_entry_count=0.5,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = Engine.build(args.model, config, device="cuda", dtype="bfloat16", backend="turbo")
    engine.backend.model.fp8_codes = not args.no_fp8_codes  # type: ignore[attr-defined]
    vocab = engine.backend.vocab_size

    def prefill_round(seed: int) -> None:
        for i, prompt in enumerate(random_prompts(args.prompts, args.input_len, vocab, seed)):
            engine.add(Sequence(f"{seed}-{i}", prompt, ONE_TOKEN))
        steps = 0
        while engine.has_work:
            engine.step()
            steps += 1
        if steps != 1:
            raise RuntimeError(f"a round took {steps} steps, not one prefill step")

    for seed in range(2):
        prefill_round(seed)
    times = []
    for seed in range(2, 7):
        torch.cuda.synchronize()
        start = time.perf_counter()
        prefill_round(seed)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step_ms = statistics.median(times) * 1e3
    label = f"quantization={args.quantization} kv={args.kv_cache_dtype}"
    if args.separate_moe_activation:
        label += " separate-moe-activation"
    print(f"{label}: prefill step of {tokens} tokens {step_ms:.1f} ms, "
          f"{tokens / step_ms * 1e3:,.0f} tok/s", flush=True)  # fmt: skip
    print_kernels(kernel_table(lambda n: prefill_round(7 + n), 3), args.top, step_ms)


if __name__ == "__main__":
    main()
