"""How fast one GPU reads memory it only reads (no writes), against the copy figure the
batch-1 floors divide by (scripts/families_bench.py: read + written bytes of a 2 GiB
copy). CUDA only.

    python3 scripts/read_bw_bench.py [--gib 2]
    python3 scripts/read_bw_bench.py --sizes 201.3,100.7,50.3,33.6

`--sizes` (MB): the plain loads' best settings on buffers of a product's size instead,
over copies past L2 (what one launch of that many bytes takes, ramp and tail included).

Each kernel streams a buffer past the L2 cache once and XORs the words a program reads
(nothing the compiler can drop): Triton's plain loads, loads marked evict-first, and
16-byte loads in PTX that skip L1 and ask L2 to fetch 256 bytes a miss
(`ld.global.nc.L1::no_allocate.L2::256B.v4`), each at several program counts, block
sizes and warps. Also torch's sum of the buffer as bf16 and the copy itself. Medians of
CUDA-graph replays; one JSON line a setting, and a summary table, on stdout and in
$OUT/read_bw.json.
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

from scripts.w4a16_tiles import L2_BYTES, time_us


@triton.jit
def _load_256b(ptrs):
    """16 bytes at each pointer (of int32 words, 16-byte aligned), as four int32 tensors."""
    return tl.inline_asm_elementwise(
        "ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        [ptrs],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=False,
        pack=1,
    )


@triton.jit
def _read_kernel(src, out, chunk, BLOCK: tl.constexpr, HOW: tl.constexpr):
    """XOR of the program's chunk of int32 words, BLOCK words a step. HOW: 0 plain
    tl.load, 1 evict-first, 2 the PTX 16-byte loads (BLOCK / 4 of them a step)."""
    start = tl.program_id(0).to(tl.int64) * chunk
    if HOW == 2:
        acc = tl.zeros([BLOCK // 4], dtype=tl.int32)
        lanes = tl.arange(0, BLOCK // 4) * 4
        for off in range(start, start + chunk, BLOCK):
            a, b, c, d = _load_256b(src + off + lanes)
            acc ^= a ^ b ^ c ^ d
    else:
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(start, start + chunk, BLOCK):
            ptrs = src + off + tl.arange(0, BLOCK)
            if HOW == 1:
                acc ^= tl.load(ptrs, eviction_policy="evict_first")
            else:
                acc ^= tl.load(ptrs)
    tl.store(out + tl.program_id(0), tl.xor_sum(acc, axis=0))


def read_call(
    src: torch.Tensor, out: torch.Tensor, *, per_sm: int, block: int, warps: int, how: int = 0
) -> tuple[Callable[[], object], int]:
    """A launch of _read_kernel over src (int32) at per_sm programs a multiprocessor, and
    the bytes it reads: each program whole steps of block words, the rest left unread."""
    programs = per_sm * torch.cuda.get_device_properties(src.device).multi_processor_count
    chunk = src.numel() // programs // block * block
    call = partial(
        _read_kernel[(programs,)], src, out, chunk, BLOCK=block, HOW=how, num_warps=warps
    )
    return call, programs * chunk * 4


SIZE_SETTINGS = [(8, 1024, 4), (16, 1024, 8), (16, 2048, 8), (4, 2048, 8), (8, 2048, 4)]


def stream_sizes(sizes: list[float]) -> None:
    """Plain loads of a buffer of each size (MB), rotated over copies past L2."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(16 * sms, dtype=torch.int32, device="cuda")
    for mb in sizes:
        words = int(mb * 1e6) // 4
        copies = [
            torch.randint(0, 2**31 - 1, (words,), dtype=torch.int32, device="cuda")
            for _ in range(max(2, L2_BYTES // (words * 4)))
        ]
        best = []
        for per_sm, block, warps in SIZE_SETTINGS:
            calls = [read_call(src, out, per_sm=per_sm, block=block, warps=warps) for src in copies]
            us = time_us([call for call, _ in calls])
            best.append((us, per_sm, block, warps, calls[0][1] / 1e6))
        best.sort()
        us, per_sm, block, warps, read_mb = best[0]
        row = {"mb": round(read_mb, 1), "us": round(us, 2), "tb_s": round(read_mb / us, 3),
               "setting": f"{per_sm}/SM block {block} warps {warps}"}  # fmt: skip
        print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--programs", default="2,4,8,16", help="programs a multiprocessor")
    p.add_argument("--blocks", default="1024,2048,4096", help="int32 words a program step")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--sizes", default="", help="MB: time streams of these sizes instead")
    args = p.parse_args()
    if args.sizes:
        stream_sizes([float(mb) for mb in args.sizes.split(",")])
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    words = int(args.gib * (1 << 30)) // 4
    src = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device="cuda")
    nbytes = words * 4
    rows = []

    def record(label: str, us: float, moved: int) -> None:
        row = {"kernel": label, "us": round(us, 1), "tb_s": round(moved / us / 1e6, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    copy_to = torch.empty_like(src)
    record(
        "torch copy (read + written)", time_us([lambda: copy_to.copy_(src)], replays=20), 2 * nbytes
    )
    copy_to.resize_(0)  # its memory back for the rest
    as_bf16 = src.view(torch.bfloat16)
    record(
        "torch sum, bf16", time_us([lambda: as_bf16.sum(dtype=torch.float32)], replays=20), nbytes
    )
    out = torch.empty(16 * sms * 16, dtype=torch.int32, device="cuda")
    for how, name in ((0, "plain"), (1, "evict_first"), (2, "ptx L2::256B")):
        for per_sm in map(int, args.programs.split(",")):
            for block in map(int, args.blocks.split(",")):
                for warps in map(int, args.warps.split(",")):
                    call, read = read_call(
                        src, out, per_sm=per_sm, block=block, warps=warps, how=how
                    )
                    label = f"{name} {per_sm}/SM block {block} warps {warps}"
                    record(label, time_us([call], replays=20), read)
    best: dict[str, dict[str, object]] = {}
    for row in rows:
        family = str(row["kernel"]).split(" ")[0]
        if family not in best or float(row["tb_s"]) > float(best[family]["tb_s"]):  # type: ignore[arg-type]
            best[family] = row
    print("best of each:", flush=True)
    for row in best.values():
        print(f"  {row['kernel']}: {row['tb_s']} TB/s", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "read_bw.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
