"""A decode step's time, one GPU against a tensor-parallel group (issue 23's "decode step
at batch 1 <= 0.65x of TP 1's"), on turbo with CUDA graphs, random bf16 weights.

    python3 scripts/tp_step.py MODEL_DIR --tp 1,2 --batches 1,64 [--context 512]
        [--fused-batch1]

For each size N, N processes (rank r on cuda:r, NCCL) load their shards, prefill B
prompts of --context tokens, capture the decode graphs, then run 8 warm-up and --steps
timed decode steps of B sequences; rank 0 prints one JSON line per (N, B) with the median
step in ms. The same prompts and steps on every size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lmd.engine.backend import ForwardBatch
from lmd.engine.kv_pool import KVPool
from lmd.engine.parallel import join_group, leave_group
from lmd.engine.turbo.backend import TurboBackend

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
        fused = [True, False] if args.separate_batch1 and batch == 1 else [True]
        for variant in fused:  # the same steps again with the norms in kernels of their own
            if not variant:
                backend.model.fused_batch1 = False
                backend.capture_graphs(pool.kv, max(batches))
            times = []
            for n in range(8 + args.steps):
                lens = [args.context + n] * batch
                step = ForwardBatch.pack([[5]] * batch, lens, tables, BLOCK)
                torch.cuda.synchronize()
                began = time.perf_counter()
                backend.forward(step, pool.kv)
                torch.cuda.synchronize()
                if n >= 8:
                    times.append(time.perf_counter() - began)
            if rank == 0:
                line: dict[str, Any] = {
                    "model": Path(args.model).name,
                    "tp": size,
                    "batch": batch,
                    "context": args.context,
                    "fused_batch1": variant,
                    "step_ms": round(1e3 * statistics.median(times), 3),
                    "step_ms_p90": round(1e3 * sorted(times)[int(0.9 * len(times))], 3),
                    "device": torch.cuda.get_device_name(device),
                }
                print(json.dumps(line), flush=True)
    leave_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
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
