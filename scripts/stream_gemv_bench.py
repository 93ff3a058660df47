"""One row times a matrix with programs that stream long runs, against vector_gemv: does a
batch-1 product read its weights as fast as a read-only stream (scripts/read_bw_bench.py)
when each program walks many blocks of rows in one loop? CUDA only.

    python3 scripts/stream_gemv_bench.py [--shapes 24576x4096,4096x12288,6144x4096,4096x4096]

A program of `_stream_gemv_kernel` takes every P-th block of BLOCK_N rows (P programs, a
few a multiprocessor) and walks its blocks and their K slices as one flattened loop, so
the loads of a block's first slice are in flight while the block before is summed
(Triton pipelines one loop, not a loop nest); vector_gemv's programs each own one block
and fill and drain their own pipeline. Plain products (no norm, no activation): the
question is the loads. Each setting is checked against F.linear and timed as
gemv_bench.py times (CUDA-graph replays over copies of the weights past L2).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from functools import partial

import torch
import triton
import triton.language as tl

from lmd.engine.turbo import kernels
from scripts.gemv_bench import past_l2
from scripts.w4a16_tiles import rel_err, time_us


@triton.jit
def _stream_gemv_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr, w_ptr, y_ptr, n, k, blocks_per_program, K_STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for it in tl.range(0, blocks_per_program * K_STEPS, num_stages=STAGES):
        block = pid + (it // K_STEPS) * programs
        k0 = (it % K_STEPS) * BLOCK_K
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        live = rows < n
        w = tl.load(
            w_ptr + rows[:, None].to(tl.int64) * k + k0 + ks[None, :],
            mask=live[:, None],
            other=0.0,
        )
        x = tl.load(x_ptr + k0 + ks)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        if it % K_STEPS == K_STEPS - 1:
            tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=live)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)


@triton.jit
def _prefetch_gemv_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr, w_ptr, y_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """vector_gemv's plain loop (a program a block of rows, all of K), its weights loaded
    a slice ahead into registers instead of through shared memory (launched with one
    stage, so Triton adds no pipeline of its own)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < n
    ks = tl.arange(0, BLOCK_K)
    base = w_ptr + rows[:, None].to(tl.int64) * k + ks[None, :]
    ahead = tl.load(base, mask=live[:, None], other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        w = ahead
        nxt = k0 + BLOCK_K
        ahead = tl.load(base + nxt, mask=live[:, None] & (nxt < k), other=0.0)
        x = tl.load(x_ptr + k0 + ks)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=live)


def prefetch_gemv(
    x: torch.Tensor, w: torch.Tensor, *, block_n: int, block_k: int, warps: int, stages: int
) -> torch.Tensor:
    """x: [1, K], w: [N, K] -> [1, N] by _prefetch_gemv_kernel, a program a block of rows
    (stages: Triton's own pipeline on top, 1 for none)."""
    n, k = w.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _prefetch_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages
    )
    return y


def stream_gemv(
    x: torch.Tensor, w: torch.Tensor, *, per_sm: int, block_n: int, block_k: int,
    warps: int, stages: int,
) -> torch.Tensor:  # fmt: skip
    """x: [1, K], w: [N, K] (K a multiple of block_k) -> [1, N]."""
    n, k = w.shape
    blocks = triton.cdiv(n, block_n)
    programs = min(blocks, per_sm * torch.cuda.get_device_properties(0).multi_processor_count)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _stream_gemv_kernel[(programs,)](
        x, w, y, n, k, triton.cdiv(blocks, programs), K_STEPS=k // block_k, BLOCK_N=block_n,
        BLOCK_K=block_k, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return y


SETTINGS = [  # stream_gemv's keyword arguments
    {"per_sm": p, "block_n": bn, "block_k": bk, "warps": w, "stages": s}
    for p in (2, 4, 8)
    for bn, bk in ((4, 1024), (8, 512), (16, 256), (8, 1024), (16, 512))
    for w in (4, 8)
    for s in (2, 3)
]
PREFETCH_SETTINGS = [  # prefetch_gemv's
    {"block_n": bn, "block_k": bk, "warps": w, "stages": s}
    for bn, bk in ((2, 1024), (4, 1024), (4, 512), (8, 512), (8, 256), (16, 256), (2, 2048))
    for w in (4, 8)
    for s in (1, 2)
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="24576x4096,4096x12288,6144x4096,4096x4096")
    p.add_argument("--prefetch", action="store_true", help="_prefetch_gemv_kernel instead")
    args = p.parse_args()
    kernel: Callable[..., torch.Tensor] = prefetch_gemv if args.prefetch else stream_gemv
    settings = PREFETCH_SETTINGS if args.prefetch else SETTINGS
    print(torch.cuda.get_device_name(0), flush=True)
    results = []
    for shape in args.shapes.split(","):
        n, k = (int(d) for d in shape.split("x"))
        dense, weights = past_l2(n, k, torch.bfloat16)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), dense.float())
        base_tiles = kernels.plain_tiles(n, k, x.device)  # the model's
        base = time_us([partial(kernels.vector_gemv, x, w, tiles=base_tiles) for w in weights])
        rows = []
        for kwargs in settings:
            call = partial(kernel, x, **kwargs)
            setting = tuple(kwargs.values())
            try:
                err = rel_err(call(dense), ref)
                us = time_us([partial(call, w=w) for w in weights])
            except Exception as exc:  # a setting that does not compile is a result too
                print(f"  {setting}: {type(exc).__name__} {str(exc)[:80]}", flush=True)
                continue
            rows.append((us, setting, err))
        rows.sort()
        mb = dense.nbytes / 1e6
        print(f"N={n} K={k} ({mb:.1f} MB): vector_gemv {base_tiles} {base:.2f} us "
              f"({mb / base:.2f} TB/s)", flush=True)  # fmt: skip
        for us, setting, err in rows[:6]:
            flag = " !! ERROR" if err > 2e-2 else ""
            print(f"  {kernel.__name__} {setting}: {us:7.2f} us {mb / us:.2f} TB/s"
                  f" err {err:.1e}{flag}", flush=True)  # fmt: skip
        results.append({"n": n, "k": k, "vector_gemv_us": base, "best": rows[:6]})
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "stream_gemv.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
