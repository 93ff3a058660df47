"""FP8 GEMMs (kernels/fp8.py) against bf16 at Llama-3-8B's projection shapes.

    python3 scripts/fp8_bench.py [--rows 1,64,512,8192] [--eager]

Each row times, in microseconds, y = x @ W^T for x [M, K] bf16:
- bf16: F.linear on a bf16 W (cuBLAS); gemv: the turbo backend's bf16 gemv (M <= 16);
- chan, block: Fp8Weight.matmul with per-channel and 128x128-block scales, as the model
  calls it: up to 16 rows the native kernel on bf16 x (kernels/fp8_rows.py); past that x
  quantized per token (per 128-group for blocks; the quantizer's time included) and
  torch._scaled_mm (cuBLAS) where it takes the scales, else the Triton kernel;
- triton: the Triton kernel where the model calls another: up to 16 rows the per-channel
  product on bf16 x (the native kernel's stand-in), past that the block-scaled one on
  quantized x (cuBLAS's stand-in).
Then TFLOP/s of the faster fp8 path and its speed-up over the faster bf16 one. The
columns run kernels/fp8.py's FAST_ACCUM as set (on); with --fast-accum, past 16 rows:
the per-channel product timed with it on and the error of both settings against the
float32 product of what was multiplied (norm of the difference over the reference's).
With --native-warps 4,8,16, up to 16 rows: the native per-channel product at each of
those warps a CTA (kernels/fp8_rows.py; its default is w4a16_rows.default_warps'). The calls
run in a CUDA graph (no launch overhead, as the turbo backend's decode steps), cycling
through enough copies of W that each call reads its weights from HBM, not from the 50 MB
of L2. Needs CUDA only (torch + triton).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

if importlib.util.find_spec("lmd") is None:  # run from a checkout: daemon/ is lmd
    _root = Path(__file__).resolve().parents[1] / "daemon"
    _spec = importlib.util.spec_from_file_location(
        "lmd", _root / "__init__.py", submodule_search_locations=[str(_root)]
    )
    assert _spec is not None and _spec.loader is not None
    sys.modules["lmd"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["lmd"])

from lmd.engine.turbo.kernels import fp8 as fp8_kernels
from lmd.engine.turbo.kernels import fp8_quant, fp8_rows
from lmd.engine.turbo.kernels.gemv import MAX_ROWS, gemv
from lmd.engine.turbo.quant.fp8 import Fp8Weight, fp8_supported

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate|up, down
ROTATE_BYTES = 256 << 20  # weights cycled per timing: well past the L2


def time_us(calls: list[Callable[[], object]], reps: int, eager: bool) -> float:
    """Mean microseconds per call over `reps` rounds of `calls` (one per weight copy)."""
    for call in calls:  # compile, warm up
        call()
    torch.cuda.synchronize()

    def run_all() -> None:
        for _ in range(reps):
            for call in calls:
                call()

    run = run_all
    if not eager:
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:  # warm up on the side stream, as graph capture wants
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
        run = graph.replay
    run()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    run()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3 / (reps * len(calls))


def triton_block(x: Tensor, w: Fp8Weight) -> Tensor:
    """The block-scaled product through the Triton kernel (where cuBLAS cannot run it)."""
    xq, xs = fp8_quant.quantize_per_token_group(x)
    return fp8_kernels.fp8_gemm(
        xq, xs, w.weight, w.scale, out_dtype=torch.bfloat16, block_scaled=True
    )


def triton_rows(x: Tensor, w: Fp8Weight) -> Tensor:
    """The per-channel product of a few 16-bit rows through the Triton kernel."""
    return fp8_kernels.fp8_gemm(x, None, w.weight, w.scale, out_dtype=x.dtype, block_scaled=False)


def fast_accum(x: Tensor, chan: list[Fp8Weight], reps: int, eager: bool) -> str:
    """The per-channel product with fast accumulation: its time, and the error of both."""
    w, setting = chan[0], fp8_kernels.FAST_ACCUM
    xq, xs = fp8_quant.quantize_per_token(x)
    ref = (xq.float() * xs) @ w.dequantize().t()
    out = []
    for fast in (False, True):
        fp8_kernels.FAST_ACCUM = fast
        y = w.matmul(x).float()
        out.append(float((y - ref).norm() / ref.norm()))
    t_fast = time_us([partial(w.matmul, x) for w in chan], reps, eager)  # captured fast
    fp8_kernels.FAST_ACCUM = setting
    return f" fast {t_fast:.1f} us, error {out[0]:.2e} -> {out[1]:.2e}"


def native_warps(x: Tensor, chan: list[Fp8Weight], warps: list[int], reps: int, eager: bool) -> str:
    """The native kernel's time at each count of warps a CTA (that its registers allow)."""
    times = []
    for w in warps:
        if w > (16 if len(x) <= 8 else 8):
            continue
        calls: list[Callable[[], object]] = [
            partial(fp8_rows.native_rows, x, c.weight, c.scale, None, block_scaled=False, warps=w)
            for c in chan
        ]
        times.append(f"{w}: {time_us(calls, reps, eager):.1f}")
    return " warps " + ", ".join(times)


def bench_shape(  # noqa: PLR0917  # the command line's values
    n: int, k: int, rows: list[int], reps: int, eager: bool, fast: bool, warps: list[int]
) -> None:
    dev = torch.device("cuda")
    copies = max(1, -(-ROTATE_BYTES // (n * k * 2)))
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    chan = [Fp8Weight.quantize(w, torch.bfloat16) for w in w16]
    block = [Fp8Weight.quantize(w, torch.bfloat16, (128, 128)) for w in w16]
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        t_bf16 = time_us([partial(F.linear, x, w) for w in w16], reps, eager)
        t_gemv = time_us([partial(gemv, x, w) for w in w16], reps, eager) if m <= MAX_ROWS else 0.0
        t_chan = time_us([partial(w.matmul, x) for w in chan], reps, eager)
        t_block = time_us([partial(w.matmul, x) for w in block], reps, eager)
        if m > fp8_kernels.SMALL_ROWS:
            t_triton = time_us([partial(triton_block, x, w) for w in block], reps, eager)
        else:
            t_triton = time_us([partial(triton_rows, x, w) for w in chan], reps, eager)
        best = min(t_chan, t_block)
        base = min(t_bf16, t_gemv or t_bf16)
        cells = [f"{t:{width}.1f}" if t else f"{'-':>{width}}" for t, width in
                 [(t_bf16, 9), (t_gemv, 9), (t_chan, 9), (t_block, 9), (t_triton, 9)]]  # fmt: skip
        tflops = 2 * m * n * k / best / 1e6
        line = f"{n:6d} {k:6d} {m:5d} " + " ".join(cells) + f" {tflops:7.0f} {base / best:6.2f}x"
        if fast and m > fp8_kernels.SMALL_ROWS:
            line += fast_accum(x, chan, reps, eager)
        if warps and m <= fp8_kernels.SMALL_ROWS:
            line += native_warps(x, chan, warps, reps, eager)
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,64,512,8192", help="M values, comma-separated")
    parser.add_argument("--reps", type=int, default=20, help="rounds over the weight copies")
    parser.add_argument("--eager", action="store_true", help="time without a CUDA graph")
    parser.add_argument("--fast-accum", action="store_true", help="also cuBLAS's fast sums")
    parser.add_argument("--native-warps", default="", help="e.g. 4,8,16: the native kernel's")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_bench needs a CUDA GPU")
    reason = fp8_supported("cuda")
    if reason:
        sys.exit(reason)
    rows = [int(r) for r in args.rows.split(",")]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    header = f"{'N':>6} {'K':>6} {'M':>5} {'bf16':>9} {'gemv':>9} {'chan':>9} {'block':>9}"
    print(header + f" {'triton':>9} {'TFLOP/s':>7} {'speedup':>7}")
    for n, k in SHAPES:
        warps = [int(w) for w in args.native_warps.split(",") if w]
        bench_shape(n, k, rows, args.reps, args.eager, args.fast_accum, warps)


if __name__ == "__main__":
    main()
