"""lmd's offline engine on one model at several batch sizes, and its batch-1 decode step
against the HBM floor (docs/benchmarks.md, "turbo for Qwen3 and mixtures of experts").

    python3 scripts/families_bench.py MODEL_DIR [--batches 1,64,512] [--input-len 512]
        [--output-len 256] [--backend turbo] [--quantization w4a16|fp8]
        [--kv-cache-dtype int8|fp8] [--separate-batch1] [--separate-activation]
        [--separate-experts] [--separate-rotary] [--separate-merge]
        [--separate-rotary-merge] [--separate-w4a16-norms] [--separate-w4a16-silu]
        [--gemv-plain]
        [--rotary-whole] [--h100-tiles]
        [--wide-max-rows 16] [--no-wgmma] [--no-fp8-codes] [--exact-accum]
        [--act-order]

One Engine for every batch (max_batch_size = the largest), the prompts and the timing of
`lmd-bench offline` (random ids, greedy, ignore_eos, prefill included), after a warm-up
at each batch's size (other prompts, 2 tokens). Prints a JSON
line per batch, then one for the step: the batch-1 decode step (the time of 256 output
tokens less that of 1, over 255 steps: the prompt's prefill cancels), the bytes a step
must read (weights, less the embedding table when untied, less the experts a token does
not use; plus the KV of 512 tokens), the device's copy bandwidth (read + write of a
2 GiB copy) and their quotient, the floor. `--act-order` (W4A16) then gives every
layer's qkv, o and gate|up a random input order, as an act-order GPTQ checkpoint's
(qkv's and gate|up's inputs ordered by their norms, o's gathered; down's order is
folded into gate|up at load), and
times the batches and the step again: the outputs change, the times are such a
checkpoint's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lmd.bench.offline import random_prompts, time_engine
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.kv_pool import block_bytes_of
from lmd.engine.turbo.kernels import fp8, rotary, w4a16_rows

# the module (the package's `vector_gemv` is its function)
vector_gemv: Any = importlib.import_module("lmd.engine.turbo.kernels.vector_gemv")

ROTARY_HEADS, IS_H200 = rotary.Q_HEADS_A_PROGRAM, vector_gemv._is_h200


def model_flag(*names: str, on_value: bool) -> Callable[[Any, bool], None]:
    """A switch that sets TurboModel's `names` to on_value, and back to its opposite."""

    def switch(model: Any, on: bool) -> None:
        for name in names:
            setattr(model, name, on_value if on else not on_value)

    return switch


def separate_w4a16(model: Any, on: bool) -> None:
    """The one-row 4-bit products' norms, and 1-16 rows' SiLU, in launches of their own."""
    model.w4a16_norms = not on
    w4a16_rows.ROWS_GATED = not on


# --FLAG: (what it measures, switch(turbo's model, on)); its line's key FLAG_batch1_step_ms
STEP_SWITCHES: dict[str, tuple[str, Callable[[Any, bool], None]]] = {
    "separate-batch1": (
        "with TurboModel.fused_batch1 off (the norms' own kernels)",
        model_flag("fused_batch1", on_value=False),
    ),
    "separate-activation": (
        "with the MLP's activation in a kernel of its own (fused_activation off)",
        model_flag("fused_activation", on_value=False),
    ),
    "separate-experts": (
        "with a layer of experts through kernels/moe.py's 8 launches (vector_experts off)",
        model_flag("vector_experts", on_value=False),
    ),
    "separate-rotary": (
        "with the rotary and K/V write in a kernel of its own (fused_rotary off)",
        model_flag("fused_rotary", on_value=False),
    ),
    "separate-merge": (
        "with decode attention's splits merged in a kernel of its own (fused_merge off)",
        model_flag("fused_merge", on_value=False),
    ),
    "separate-rotary-merge": (
        "with both of the last two in kernels of their own",
        model_flag("fused_rotary", "fused_merge", on_value=False),
    ),
    "separate-w4a16-norms": (
        "with a 4-bit one-row product's RMSNorm in a kernel of its own (w4a16_norms off)",
        model_flag("w4a16_norms", on_value=False),
    ),
    "separate-w4a16-silu": (
        "with both 4-bit norms and, at 1-16 rows, SiLU's gate in kernels of their own",
        separate_w4a16,
    ),
    "gemv-plain": (
        "with o and down through kernels/gemv.py (vector_plain off)",
        model_flag("vector_plain", on_value=False),
    ),
    "rotary-whole": (
        "with a token's heads rotated in one program (rotary.Q_HEADS_A_PROGRAM 0)",
        lambda _, on: setattr(rotary, "Q_HEADS_A_PROGRAM", 0 if on else ROTARY_HEADS),
    ),
    "h100-tiles": (
        "with vector_gemv's tiles as swept on an H100, on any device",
        lambda _, on: setattr(vector_gemv, "_is_h200", (lambda _d: False) if on else IS_H200),
    ),
}


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second moved by a device-to-device copy (read + written), median of 20."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times[5:])


def step_bytes(engine: Engine, context: int) -> int:
    """What one batch-1 decode step reads at `context` tokens: every weight it uses once
    (one row of an untied embedding table: ~0), and the context's K and V."""
    model = engine.backend.model  # type: ignore[attr-defined]  # turbo's
    w, c = model.weights, model.config
    total = w.nbytes
    if w.lm_head is not w.embed:
        total -= w.embed.numel() * w.embed.element_size()
    for layer in w.layers:
        if layer.experts is not None:
            unused = 1 - c.moe.top_k / c.moe.num_experts
            experts = layer.experts.gate_up.nbytes + layer.experts.down.nbytes
            total -= int(experts * unused)
    kv = block_bytes_of(engine.backend, 1) * context  # a one-token block: its K, V (scales)
    return total + kv


def batch1_step(engine: Engine, input_len: int, output_len: int) -> float:
    """Seconds a batch-1 decode step takes: (output_len tokens - 1 token) / (output_len -
    1), the best of 3 (the prompt's prefill cancels)."""
    one = random_prompts(1, input_len, engine.backend.vocab_size, 2)
    runs = [(time_engine(engine, one, output_len)[0], time_engine(engine, one, 1)[0])
            for _ in range(3)]  # fmt: skip
    return min(full - first for full, first in runs) / (output_len - 1)


def step_with(
    engine: Engine, switch: Callable[[bool], None], args: argparse.Namespace, max_batch: int
) -> float:
    """The batch-1 step with `switch(True)`, then switched back (graphs recaptured each
    way)."""
    switch(True)
    engine.backend.capture_graphs(engine.pool.kv, max_batch)
    seconds = batch1_step(engine, args.input_len, args.output_len)
    switch(False)
    engine.backend.capture_graphs(engine.pool.kv, max_batch)
    return seconds


def run_batches(
    engine: Engine, batches: list[int], args: argparse.Namespace, act_order: bool = False
) -> None:
    """A JSON line of output tokens/s per batch, after a warm-up at its shapes (other
    prompts: no prefix-cache hits later), so that no first compile is timed."""
    vocab = engine.backend.vocab_size
    for batch in batches:
        time_engine(engine, random_prompts(batch, args.input_len, vocab, 3), 2)
        prompts = random_prompts(batch, args.input_len, vocab, 0)
        seconds, tokens = time_engine(engine, prompts, args.output_len)
        rate = round(tokens / seconds, 1)
        print(json.dumps({"model": args.model.name, "backend": engine.backend.name,
                          "quantization": engine.backend.quantization,
                          "kv_cache_dtype": engine.backend.kv_cache_dtype,
                          "num_blocks": engine.pool.num_blocks, "act_order": act_order,
                          "batch": batch, "seconds": round(seconds, 3),
                          "output_tokens_per_s": rate}), flush=True)  # fmt: skip


def give_act_order(model: Any) -> None:
    """Every layer's qkv, o and gate|up (W4A16) a random input order (--act-order)."""
    for layer in model.weights.layers:
        for name in ("qkv", "o", "gate_up"):
            weight = getattr(layer, name)
            perm = torch.randperm(weight.shape[1], device=weight.device)
            setattr(layer, name, dataclasses.replace(weight, perm=perm))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", type=Path)
    parser.add_argument("--batches", default="1,64,512")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--backend", default="turbo")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    for flag, (what, _) in STEP_SWITCHES.items():
        parser.add_argument(f"--{flag}", action="store_true", help=f"the batch-1 step again {what}")
    parser.add_argument(
        "--no-fp8-codes",
        action="store_true",
        help="FP8: each product quantizes its input in a launch of its own (fp8_codes off)",
    )
    parser.add_argument(
        "--wide-max-rows",
        type=int,
        default=None,
        help="W4A16: the most rows the native wide kernel takes (16: the Triton tiles past 16)",
    )
    parser.add_argument(
        "--no-wgmma",
        action="store_true",
        help="W4A16: 33-64 rows to the Triton tiles on Hopper too (w4a16_rows.WGMMA off)",
    )
    parser.add_argument(
        "--exact-accum",
        action="store_true",
        help="FP8: cuBLAS's sums promoted to float32 (fp8.FAST_ACCUM off)",
    )
    parser.add_argument(
        "--act-order",
        action="store_true",
        help="W4A16: then everything again with act-order inputs (gathered a product)",
    )
    args = parser.parse_args()
    fp8.FAST_ACCUM = not args.exact_accum
    if args.wide_max_rows is not None:
        w4a16_rows.WIDE_MAX_ROWS = args.wide_max_rows
    w4a16_rows.WGMMA = not args.no_wgmma
    batches = [int(b) for b in args.batches.split(",")]
    config = EngineConfig(
        max_batch_size=max(batches),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = Engine.build(args.model, config, device="cuda", dtype="bfloat16", backend=args.backend)
    if args.no_fp8_codes:
        engine.backend.model.fp8_codes = False  # type: ignore[attr-defined]  # turbo's
    time_engine(engine, random_prompts(1, args.input_len, engine.backend.vocab_size, 1), 4)
    run_batches(engine, batches, args)
    step = batch1_step(engine, args.input_len, args.output_len)
    model = getattr(engine.backend, "model", None)  # turbo's, which the switches set
    if args.act_order:
        give_act_order(model)
        engine.backend.capture_graphs(engine.pool.kv, max(batches))
        run_batches(engine, batches, args, act_order=True)
        again = batch1_step(engine, args.input_len, args.output_len)
        line = {"model": args.model.name, "batch1_step_ms": round(step * 1e3, 3),
                "act_order_batch1_step_ms": round(again * 1e3, 3)}  # fmt: skip
        print(json.dumps(line), flush=True)
        return
    for flag, (_, switch) in STEP_SWITCHES.items():
        name = flag.replace("-", "_")
        if getattr(args, name):
            again = step_with(engine, partial(switch, model), args, max(batches))
            line = {"model": args.model.name, "batch1_step_ms": round(step * 1e3, 3),
                    f"{name}_batch1_step_ms": round(again * 1e3, 3)}  # fmt: skip
            print(json.dumps(line), flush=True)
    if engine.backend.name != "turbo":  # the floor's bytes are counted on turbo's weights
        print(json.dumps({"model": args.model.name, "backend": engine.backend.name,
                          "batch1_step_ms": round(step * 1e3, 3)}), flush=True)  # fmt: skip
        return
    device = engine.backend.device
    needed = step_bytes(engine, args.input_len)
    bandwidth = copy_bandwidth(device)
    floor = needed / bandwidth
    print(json.dumps({"model": args.model.name, "quantization": engine.backend.quantization,
                      "batch1_step_ms": round(step * 1e3, 3),
                      "step_bytes_gb": round(needed / 1e9, 2),
                      "copy_bandwidth_tb_s": round(bandwidth / 1e12, 2),
                      "floor_ms": round(floor * 1e3, 3),
                      "step_over_floor": round(step / floor, 3)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
