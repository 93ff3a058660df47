"""A decode step's time, one GPU against a tensor-parallel group (issue 23's "decode step
at batch 1 <= 0.65x of TP 1's"), on turbo with CUDA graphs, random bf16 weights.

    python3 scripts/tp_step.py MODEL_DIR --tp 1,2 --batches 1,64 [--context 512]
        [--separate-batch1] [--nccl-batch1] [--tiles 8x1024,...] [--gemv-tiles 16x512,...]
        [--separate-activation] [--variant-tp 2] [--kernels 12]

For each size N, N processes (rank r on cuda:r, NCCL) load their shards, prefill B
prompts of --context tokens, capture the decode graphs, then run 8 warm-up and --steps
timed decode steps of B sequences; rank 0 prints one JSON line per (N, B) with the median
step in ms. The same prompts and steps on every size. --kernels K: then 10 more steps
under torch.profiler (CUDA activity: the graphs' kernels one by one), and rank 0 prints
the K kernels that take most of a step (us a step, launches a step) and what they and
the rest sum to, against the step's median: where a batch-1 step's time goes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from itertools import product
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import triton

from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.kv_pool import KVPool
from lmd.engine.parallel import join_group, leave_group
from lmd.engine.turbo.backend import TurboBackend

# --tiles and --gemv-tiles replace the modules' default_tiles (looked up at each launch)
# in the ranks.
_vector_module: Any = importlib.import_module("lmd.engine.turbo.kernels.vector_gemv")
_gemv_module: Any = importlib.import_module("lmd.engine.turbo.kernels.gemv")
_default_tiles = _vector_module.default_tiles
_gemv_default_tiles = _gemv_module.default_tiles
Tiles = tuple[int, int] | None  # (BLOCK_N, BLOCK_K), or the kernel's own

BLOCK = 64


def rank_main(rank: int, size: int, rendezvous: str, args: argparse.Namespace) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = join_group(rank, size, Path(rendezvous), device, 600)
    backend = TurboBackend(Path(args.model), device, torch.bfloat16, tp=tp)
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-(args.context + args.steps + 16) // BLOCK)
    pool = KVPool.for_backend(backend, max(batches) * per_seq + 1, BLOCK)
    backend.capture_graphs(pool.kv, max(batches))
    exchange = backend.model.exchange  # batch-1 all-reduces over peer memory, if it fits
    base = Variant(True, True, exchange, (None, None))
    now = base  # what the graphs hold
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        prompts = torch.randint(2, backend.vocab_size, (batch, args.context), generator=gen)
        for start in range(0, batch, 8):  # prefill in groups: a step of <= 8 x context
            rows = range(start, min(batch, start + 8))
            step = ForwardBatch.pack(
                [prompts[i].tolist() for i in rows],
                [0] * len(rows),
                [tables[i] for i in rows],
                BLOCK,
            )
            backend.forward(step, pool.kv)
        decode = partial(decode_step, backend, pool, tables, args.context)
        variants = [base]
        if batch == 1 and str(size) in args.variant_tp.split(","):
            variants += batch1_variants(base, args)
        for variant in variants:
            if variant != now:
                backend.model.fused_batch1 = variant.fused_batch1
                backend.model.fused_activation = variant.fused_activation
                backend.model.exchange = variant.exchange
                use_tiles(*variant.tiles)
                now = variant
                backend.capture_graphs(pool.kv, max(batches))
            times, back_to_back, kernels = time_steps(decode, args)
            every = every_rank(kernels, rank, size) if args.kernels else []
            if rank == 0:
                line: dict[str, Any] = {
                    "model": Path(args.model).name,
                    "tp": size,
                    "batch": batch,
                    "context": args.context,
                    "fused_batch1": variant.fused_batch1,
                    "all_reduce": "peers" if variant.exchange and batch == 1 else "nccl",
                    "step_ms": round(1e3 * statistics.median(times), 3),
                    "step_ms_p90": round(1e3 * sorted(times)[int(0.9 * len(times))], 3),
                    "step_ms_back_to_back": round(1e3 * back_to_back, 3),
                    "layer_tiles": variant.tiles[0],
                    "gemv_tiles": variant.tiles[1],
                    "fused_activation": variant.fused_activation,
                    "device": torch.cuda.get_device_name(device),
                }
                print(json.dumps(line), flush=True)
                for r, rows in enumerate(every):
                    if size > 1:
                        print(f"  rank {r}:")
                    print_kernels(rows, args.kernels, line["step_ms_back_to_back"])
    leave_group()


@dataclass(frozen=True)
class Variant:
    """What a timed run's graphs were captured with."""

    fused_batch1: bool
    fused_activation: bool  # the MLP's activation in gate|up's launch (TurboModel)
    exchange: Any  # the peer exchange, or None: NCCL's all-reduces
    tiles: tuple[Tiles, Tiles]  # vector_gemv's layer tiles, gemv's tiles


def batch1_variants(base: Variant, args: argparse.Namespace) -> list[Variant]:
    """The batch-1 runs asked for beside the base one."""
    variants = []
    if args.separate_batch1:  # the norms in kernels of their own
        variants.append(replace(base, fused_batch1=False))
    if args.separate_activation:  # the activation in a kernel of its own
        variants.append(replace(base, fused_activation=False))
    if args.nccl_batch1 and base.exchange is not None:  # NCCL's all-reduces instead
        variants.append(replace(base, exchange=None))
    # every pair of the tiles asked for (each kernel's own included)
    pairs = product([None, *parse_tiles(args.tiles)], [None, *parse_tiles(args.gemv_tiles)])
    variants += [replace(base, tiles=pair) for pair in pairs if pair != (None, None)]
    return variants


def use_tiles(layer_tiles: Tiles, gemv_tiles: Tiles) -> None:
    """From now on in this process: vector_gemv's tiles for the layers' products and
    gemv's tiles, or each kernel's own (None). The modules' default_tiles, which each
    launch looks up, are replaced."""

    def vector_tiles(
        n: int, k: int, device: torch.device | None = None
    ) -> tuple[int, int, int, int]:
        block_n, block_k, warps, stages = _default_tiles(n, k, device)
        if layer_tiles is not None and n < 50000:  # the vocabulary's product keeps its own
            block_n, block_k = layer_tiles
        return block_n, min(block_k, triton.next_power_of_2(k)), warps, stages

    def gemv_default(k: int) -> tuple[int, int]:
        return gemv_tiles or _gemv_default_tiles(k)

    _vector_module.default_tiles = vector_tiles if layer_tiles is not None else _default_tiles
    _gemv_module.default_tiles = gemv_default if gemv_tiles is not None else _gemv_default_tiles


def every_rank(rows: list[Any], rank: int, size: int) -> list[Any]:
    """Every rank's `rows`, in rank order, on rank 0 (elsewhere: [])."""
    if size == 1:
        return [rows]
    every: list[Any] = [None] * size if rank == 0 else []
    dist.gather_object(rows, every if rank == 0 else None, dst=0)
    return every


def parse_tiles(text: str) -> list[tuple[int, int]]:
    """ "8x1024,16x512" -> [(8, 1024), (16, 512)]."""
    return [(int(a), int(b)) for a, b in (t.split("x") for t in text.split(",") if t)]


def decode_step(
    backend: TurboBackend, pool: KVPool, tables: list[list[int]], context: int, n: int
) -> None:
    """One decode step of every sequence of `tables` at context + n (the profiled steps
    write their slots again)."""
    step = ForwardBatch.pack([[5]] * len(tables), [context + n] * len(tables), tables, BLOCK)
    backend.forward(step, pool.kv)


def time_steps(
    decode: Callable[[int], None], args: argparse.Namespace
) -> tuple[list[float], float, list[tuple[str, float, float]]]:
    """Each step's time (synchronized before and after it), the time a step of steps
    enqueued back to back (the engine's overlapped steps hide the host's share of each
    step the same way: the GPU's time a step), and with --kernels the kernel table."""
    times = []
    for n in range(8 + args.steps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        decode(n)
        torch.cuda.synchronize()
        if n >= 8:
            times.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for n in range(args.steps):
        decode(n)
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - began) / args.steps
    return times, back_to_back, kernel_table(decode, 10) if args.kernels else []


def kernel_table(decode: Callable[[int], None], steps: int) -> list[tuple[str, float, float]]:
    """(kernel name, us a step, launches a step) over `steps` decode steps, most first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for n in range(steps):
            decode(n)
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0)
        if us > 0:
            rows.append((event.key, us / steps, event.count / steps))
    return sorted(rows, key=lambda row: -row[1])


def print_kernels(rows: list[tuple[str, float, float]], top: int, step_ms: float) -> None:
    if not rows:
        return
    total = sum(us for _, us, _ in rows)
    for name, us, count in rows[:top]:
        print(f"  {us:9.1f} us  x{count:5.1f}  {name[:90]}")
    rest = sum(us for _, us, _ in rows[top:])
    launches = sum(count for _, _, count in rows)
    print(f"  {rest:9.1f} us  the other {max(0, len(rows) - top)} kernels")
    gap = step_ms - total / 1e3
    print(f"  kernels {total / 1e3:.3f} ms a step ({launches:.0f} launches), step "
          f"{step_ms:.3f} ms: {gap:.3f} ms between kernels", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--kernels", type=int, default=0, help="print the K costliest kernels")
    parser.add_argument(
        "--tiles",
        default="",
        help="batch 1 again with vector_gemv's layer tiles BNxBK (a comma list)",
    )
    parser.add_argument(
        "--gemv-tiles",
        default="",
        help="batch 1 again with gemv's tiles BNxBK (o, down; a comma list; with each --tiles)",
    )
    parser.add_argument(
        "--separate-activation",
        action="store_true",
        help="batch 1 again with the MLP's activation in a kernel of its own",
    )
    parser.add_argument(
        "--variant-tp",
        default="1,2,4,8",
        help="the group sizes that run the batch-1 variants (the base run: every size)",
    )
    parser.add_argument(
        "--nccl-batch1",
        action="store_true",
        help="batch 1 again with NCCL's all-reduces instead of the peer exchange",
    )
    parser.add_argument(
        "--separate-batch1",
        action="store_true",
        help="batch 1 again with TurboModel.fused_batch1 off (the norms' own kernels)",
    )
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for size in (int(s) for s in args.tp.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            procs = [
                ctx.Process(target=rank_main, args=(r, size, f"{tmp}/rendezvous", args))
                for r in range(size)
            ]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
            if any(p.exitcode for p in procs):
                raise SystemExit(f"tp {size}: a rank failed")


if __name__ == "__main__":
    main()
