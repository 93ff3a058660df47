"""What one decode step's all-reduces cost a tensor-parallel group (issue 23): 2 per layer,
[rows, hidden] bf16, replayed from a CUDA graph, NCCL against PyTorch's symmetric-memory
one-shot all-reduce (peer-to-peer loads; no NVLink multicast).

    python3 scripts/allreduce_bench.py [--size 2] [--hidden 4096] [--layers 32]

Rank 0 prints one JSON line per (method, rows): microseconds per all-reduce, the median
of 20 replays of a graph of 2 x layers all-reduces.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist


def timed(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    times = []
    for _ in range(replays + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def rank_main(rank: int, size: int, path: str, args: argparse.Namespace) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{path}", rank=rank, world_size=size, device_id=device
    )
    count = 2 * args.layers
    methods: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    methods["nccl"] = nccl
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        assert group is not None
        buf = symm_mem.empty(64 * args.hidden, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, group.group_name)

        def one_shot(x: torch.Tensor) -> torch.Tensor:
            staged = buf[: x.numel()].view_as(x)
            staged.copy_(x)
            ops = torch.ops.symm_mem
            out: torch.Tensor = ops.one_shot_all_reduce(staged, "sum", group.group_name)
            return out

        methods["symm_mem_one_shot"] = one_shot
    except Exception as exc:  # reported; the NCCL figures still come
        if rank == 0:
            print(json.dumps({"symm_mem": f"unavailable: {exc!r}"[:300]}), flush=True)
    for name, reduce in methods.items():
        for rows in (1, 64):
            x = torch.ones(rows, args.hidden, dtype=torch.bfloat16, device=device)
            try:
                for _ in range(3):
                    y = reduce(x.clone())
                torch.cuda.synchronize()
                assert float(y[0, 0]) == size, float(y[0, 0])
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                with torch.cuda.graph(graph, stream=stream):
                    y = x
                    for _ in range(count):
                        y = reduce(y) * 0.5
                ms = timed(graph)
            except Exception as exc:
                if rank == 0:
                    print(json.dumps({name: f"failed: {exc!r}"[:300]}), flush=True)
                break
            if rank == 0:
                line = {"method": name, "rows": rows, "hidden": args.hidden, "size": size,
                        "us_per_all_reduce": round(1e3 * ms / count, 2)}  # fmt: skip
                print(json.dumps(line), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=rank_main, args=(r, args.size, f"{tmp}/rv", args))
            for r in range(args.size)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()


if __name__ == "__main__":
    main()
