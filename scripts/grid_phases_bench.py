"""What a grid-wide wait costs inside one launch, against a launch boundary in a CUDA
graph, at the byte counts of a layer of experts for one token (Qwen3-30B-A3B: router
0.5 MB, the 8 chosen experts' gate|up 50.3 MB, their down 25.2 MB). CUDA only.

    python3 scripts/grid_phases_bench.py [--programs 1,2,4] [--block 2048,4096]

Stand-ins, not the model's kernels: each phase streams its bytes (float32 loads summed
a program), so the figures say what the boundaries cost, not what the products do.

- launches: three launches, one a phase (as kernels/moe_vector.py runs the experts);
- waits: one launch of P programs (P a multiple of the multiprocessors, all resident),
  a grid-wide wait between phases (an atomic count and a poll);
- waits, ahead: the same, with each program's first block of the next phase loaded
  before it waits;
- empty launches and bare waits, 16 of each, to tell the boundary's own cost.

Times are medians of CUDA-graph replays over copies of the buffers past the L2 cache
(scripts/w4a16_tiles.py's time_us).
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch
import triton
import triton.language as tl

from scripts.w4a16_tiles import time_us

PHASE_BYTES = (0.5e6, 50.3e6, 25.2e6)
COPIES = 4  # 4 x 76 MB: past the 50 MB L2 between two replays of a set


@triton.jit
def _grid_wait(count_ptr, target):
    """Count this program in, then wait until target programs are in."""
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _leave(count_ptr):
    """The last program out sets both counters back to 0 for the next launch."""
    if tl.atomic_add(count_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(count_ptr, 0)
        tl.store(count_ptr + 1, 0)


@triton.jit
def _stream(src, start, chunk, first, BLOCK: tl.constexpr):
    """The sum of src[start : start + chunk], its first BLOCK already loaded (first)."""
    acc = first
    for off in range(start + BLOCK, start + chunk, BLOCK):
        acc += tl.load(src + off + tl.arange(0, BLOCK))
    return tl.sum(acc, axis=0)


@triton.jit
def _phase_kernel(src, out, chunk, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * chunk
    first = tl.load(src + start + tl.arange(0, BLOCK))
    tl.store(out + tl.program_id(0), _stream(src, start, chunk, first, BLOCK))


@triton.jit
def _phases_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    s0, s1, s2, out, c0, c1, c2, count_ptr, AHEAD: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    total = _stream(s0, pid * c0, c0, tl.load(s0 + pid * c0 + lanes), BLOCK)
    tl.store(out + pid, total)
    if AHEAD:
        first = tl.load(s1 + pid * c1 + lanes)
        _grid_wait(count_ptr, programs)
    else:
        _grid_wait(count_ptr, programs)
        first = tl.load(s1 + pid * c1 + lanes)
    total += _stream(s1, pid * c1, c1, first, BLOCK)
    if AHEAD:
        first = tl.load(s2 + pid * c2 + lanes)
        _grid_wait(count_ptr, 2 * programs)
    else:
        _grid_wait(count_ptr, 2 * programs)
        first = tl.load(s2 + pid * c2 + lanes)
    total += _stream(s2, pid * c2, c2, first, BLOCK)
    tl.store(out + pid, total)
    _leave(count_ptr)


@triton.jit
def _waits_kernel(count_ptr, out, WAITS: tl.constexpr):
    for i in tl.static_range(WAITS):
        _grid_wait(count_ptr, (i + 1) * tl.num_programs(0))
    tl.store(out + tl.program_id(0), 1.0)
    _leave(count_ptr)


@triton.jit
def _empty_kernel(out):
    tl.store(out + tl.program_id(0), 1.0)


def chunk_of(nbytes: float, programs: int, block: int) -> int:
    """Floats a program streams: nbytes spread, rounded up to whole blocks."""
    return -(-int(nbytes) // 4 // programs // block) * block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--programs", default="1,2,4", help="programs a multiprocessor")
    p.add_argument("--block", default="2048,4096", help="floats a program loads at once")
    p.add_argument("--warps", type=int, default=4)
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(0), f"{sms} multiprocessors", flush=True)
    results = []
    counts = torch.zeros(2, dtype=torch.int32, device="cuda")
    out = torch.zeros(16 * sms, device="cuda")
    for per_sm in map(int, args.programs.split(",")):
        programs = per_sm * sms
        empties = [partial(_empty_kernel[(programs,)], out, num_warps=args.warps)] * 16
        waits = [partial(_waits_kernel[(programs,)], counts, out, WAITS=16, num_warps=args.warps)]
        empty_us, waits_us = time_us(empties) * 16, time_us(waits, replays=20)
        for block in map(int, args.block.split(",")):
            chunks = [chunk_of(b, programs, block) for b in PHASE_BYTES]
            sets = [
                [torch.rand(programs * c, device="cuda") for c in chunks] for _ in range(COPIES)
            ]
            launches, fused, ahead = [], [], []
            for s in sets:
                for src, c in zip(s, chunks, strict=True):
                    launches.append(
                        partial(
                            _phase_kernel[(programs,)], src, out, c, BLOCK=block,
                            num_warps=args.warps,
                        )
                    )  # fmt: skip
                for bucket, on in ((fused, False), (ahead, True)):
                    bucket.append(
                        partial(
                            _phases_kernel[(programs,)], *s, out, *chunks, counts,
                            AHEAD=on, BLOCK=block, num_warps=args.warps,
                        )
                    )  # fmt: skip
            alone = [
                time_us([f for i, f in enumerate(launches) if i % 3 == phase]) for phase in range(3)
            ]
            row = {
                "programs": programs,
                "block": block,
                "bytes_mb": [round(4 * programs * c / 1e6, 2) for c in chunks],
                "phase_alone_us": [round(t, 2) for t in alone],
                "launches_us": round(time_us(launches) * 3, 2),
                "waits_us": round(time_us(fused), 2),
                "waits_ahead_us": round(time_us(ahead), 2),
                "empty_launch_us": round(empty_us / 16, 2),
                "bare_wait_us": round(waits_us / 16, 2),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
            del sets
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "grid_phases.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
