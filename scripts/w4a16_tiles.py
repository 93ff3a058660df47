"""The W4A16 GEMM (kernels/w4a16.py) against torch's 16-bit F.linear at Llama-3-8B's
linear shapes: which tiles to take where. CUDA only.

    python3 scripts/w4a16_tiles.py [--m 1,16,64,512] [--tiles 16,64,128,0,4,4 ...]
                                   [--sweep] [--dtype bf16] [--shapes 4096:4096,...]

Random weights quantized at load (group 128). Each time is the median of a few replays
of a CUDA graph that runs the product over enough copies of the weights to overflow
the L2 cache (a decode step reads every weight from memory), timed with CUDA events.
GB/s counts the packed weights, scales and zeros read once. --tiles takes
"BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,WARPS,STAGES" (SPLIT_K 0: automatic); --sweep adds a
built-in list per row count. Every tiling is checked against dequantize() first. Below
128 rows the default tiles also run with their nibbles converted one by one ("one by
one", kernels/w4a16.PACKED_NIBBLES off).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from lmd.engine.turbo.kernels import w4a16 as w4a16_kernels
from lmd.engine.turbo.kernels.w4a16 import DENSE_ROWS, Tiles, default_tiles, w4a16_matmul
from lmd.engine.turbo.quant.w4a16 import W4A16Weight

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate|up, down
L2_BYTES = 256 << 20  # rotate over copies of the weights past this (H100/H200: 50-60 MB L2)
SKINNY = [(16, 64, 128, 0), (16, 128, 128, 0), (16, 64, 256, 0), (16, 64, 128, 1)]
MID = [(64, 64, 128, 0), (64, 128, 128, 0), (64, 128, 128, 1), (32, 128, 128, 0)]
LARGE = [(128, 128, 128, 1), (64, 128, 128, 1), (128, 256, 128, 1), (64, 256, 128, 1)]
WARPS_STAGES = {"skinny": [(4, 3), (4, 4)], "mid": [(4, 3), (4, 4)], "large": [(8, 3), (4, 3)]}


def parse_tiles(text: str) -> Tiles:
    values = [int(v) for v in text.split(",")]
    if len(values) not in (6, 7):
        raise argparse.ArgumentTypeError(
            "tiles are BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,WARPS,STAGES[,SWAP_AB]"
        )
    bm, bn, bk, split, warps, stages = values[:6]
    return Tiles(bm, bn, bk, split, warps, stages, swap_ab=len(values) == 7 and bool(values[6]))


def name_of(tiles: Tiles) -> str:
    return ",".join(str(int(v)) for v in tiles)


def sweep_for(m: int) -> list[Tiles]:
    kind = "skinny" if m <= 16 else "mid" if m <= 64 else "large"
    blocks = {"skinny": SKINNY, "mid": MID, "large": LARGE}[kind]
    return [
        Tiles(*b, w, s, swap)
        for b in blocks
        for w, s in WARPS_STAGES[kind]
        for swap in (False, True)
    ]


def time_us(calls: list[Callable[[], object]], replays: int = 10) -> float:
    """Median microseconds per call: a CUDA graph runs every call once per replay."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm up (compile) outside the graph
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return float(statistics.median(times))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def bench_shape(
    n: int, k: int, ms: list[int], extra: list[Tiles], args: argparse.Namespace
) -> dict[int, tuple[float, float]]:
    """Prints a block of rows for one (N, K); returns {m: (cuBLAS us, default us)}."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    dense = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    weight = W4A16Weight.quantize(dense, 128)
    reference = weight.dequantize()  # [N, K] float32
    q_copies = max(1, min(64, L2_BYTES // weight.nbytes))
    d_copies = max(1, min(64, L2_BYTES // dense.nbytes))
    packed = [
        (weight.qweight.clone(), weight.scales.clone(), weight.zeros.clone())
        for _ in range(q_copies)
    ]
    denses = [dense] + [dense.clone() for _ in range(d_copies - 1)]
    results = {}
    for m in ms:
        x = torch.randn(m, k, device="cuda").to(dtype)
        ref = x.float() @ reference.t()
        cublas = time_us([partial(F.linear, x, d) for d in denses])
        tilings = [None, *extra, *(sweep_for(m) if args.sweep else [])]
        # (name, tiles, dense_rows, the w4a16 switch turned off: "" none)
        configs = [(name_of(t) if t else "default", t, 1 << 30, "") for t in tilings]
        configs[0] = ("default", None, DENSE_ROWS, "")
        if m < DENSE_ROWS:  # nibbles converted one by one (w4a16.PACKED_NIBBLES off)
            configs.append(("default, one by one", None, DENSE_ROWS, "PACKED_NIBBLES"))
        if m > 16:
            configs.append(("dequantize + cuBLAS", None, 1, ""))
        by_cublas = m >= DENSE_ROWS
        default_name = "dequantize + cuBLAS" if by_cublas else name_of(default_tiles(m, n))
        rows = []
        for name, tiles, dense_rows, off in configs:
            run = partial(w4a16_matmul, x, tiles=tiles, dense_rows=dense_rows)
            saved = getattr(w4a16_kernels, off) if off else None
            if off:
                setattr(w4a16_kernels, off, False)
            try:
                err = rel_err(run(*packed[0], 128), ref)
                us = time_us([partial(run, *p, 128) for p in packed])
            except Exception as exc:  # a tiling that does not compile is a result too
                print(f"  M={m} {name}: {type(exc).__name__} {str(exc)[:100]}")
                continue
            finally:
                if off:
                    setattr(w4a16_kernels, off, saved)
            rows.append((us, name, err))
        rows.sort()
        default_us = next((us for us, name, _ in rows if name == "default"), float("nan"))
        results[m] = (cublas, default_us)
        print(f"N={n} K={k} M={m}: cuBLAS {cublas:.1f} us (default {default_name})")
        for us, name, err in rows[: args.top]:
            gbs = weight.nbytes / us / 1e3
            flag = " !! ERROR" if err > 2e-2 else ""
            print(
                f"  {name:24s} {us:8.1f} us {gbs:7.0f} GB/s  x{cublas / us:5.2f} vs cuBLAS"
                f"  err {err:.1e}{flag}"
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--m", default="1,16,64,128,512", help="rows of x, comma separated")
    parser.add_argument("--tiles", type=parse_tiles, action="append", default=[])
    parser.add_argument("--sweep", action="store_true", help="add the built-in tilings")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--shapes", default="", help="N:K pairs, e.g. 4096:4096,6144:4096")
    parser.add_argument("--top", type=int, default=6, help="fastest tilings shown per row")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("w4a16_tiles.py needs a CUDA GPU")
    torch.manual_seed(0)
    ms = [int(v) for v in args.m.split(",")]
    pairs = [s.split(":") for s in args.shapes.split(",")] if args.shapes else []
    shapes = [(int(n), int(k)) for n, k in pairs] or SHAPES
    summary = {(n, k): bench_shape(n, k, ms, args.tiles, args) for n, k in shapes}
    print("\nsummary, default tiles (us): M, " + ", ".join(f"{n}x{k}" for n, k in shapes))
    for m in ms:
        cells = [f"{summary[s][m][1]:.1f} (cuBLAS {summary[s][m][0]:.1f})" for s in shapes]
        print(f"  M={m}: " + ", ".join(cells))
    if 1 in ms and set(SHAPES) <= set(shapes):
        step = 32 * sum(summary[s][1][1] for s in SHAPES) / 1e3
        dense_step = 32 * sum(summary[s][1][0] for s in SHAPES) / 1e3
        print(f"Llama-3-8B decode step, 32 layers' linears at M=1: {step:.2f} ms W4A16, "
              f"{dense_step:.2f} ms 16-bit")  # fmt: skip


if __name__ == "__main__":
    main()
