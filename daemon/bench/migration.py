"""`lmd-bench migration --transport host|cuda_ipc|nixl [--src-device cuda:0 --dst-device
cuda:1] --size-mb N --block-kb K [--repeats R] [--json]`

Moves N MiB of KV blocks of K KiB from one real process into another's pool through
lmd._native (host, cuda_ipc) or NIXL (nixl: cpu pools unless devices are given; UCX_TLS
narrows the path UCX takes), as a migration does (lmd.migration.bench_native: the
destination blocks are shuffled, the bytes verified), and measures the local copy
bandwidth of the same bytes for comparison: memcpy in one process (cpu pools), a torch
device copy (GPU pools). Prints {"transport", "bytes", "blocks", "seconds", "gbps", ...}.
"""

from __future__ import annotations

import argparse
from typing import Any

from lmd.migration.native import TRANSPORT_KINDS


def add_parser(sub: Any) -> None:
    p = sub.add_parser("migration", help="KV block transfer between two processes")
    p.add_argument("--transport", choices=(*TRANSPORT_KINDS, "nixl"), default="host")
    p.add_argument("--src-device", default=None, help="cuda_ipc, nixl: the sender's GPU (cuda:0)")
    p.add_argument("--dst-device", default=None, help="cuda_ipc, nixl: the receiver's GPU (cuda:0)")
    p.add_argument("--size-mb", type=int, default=256, help="MiB moved per batch")
    p.add_argument("--block-kb", type=int, default=1024, help="KiB per block")
    p.add_argument("--repeats", type=int, default=5, help="timed batches (median reported)")
    p.add_argument("--threads", type=int, default=0, help="host: copy threads (0 = auto)")
    p.add_argument("--direct-copies", action="store_true", help="cuda_ipc: no copy kernel")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lmd.migration.bench_native import measure_cuda_ipc, measure_host, measure_nixl

    if args.transport == "nixl":
        try:
            result = measure_nixl(
                args.size_mb,
                args.block_kb,
                src_device=args.src_device or "cpu",
                dst_device=args.dst_device or "cpu",
                repeats=args.repeats,
            )
        except RuntimeError as exc:  # NIXL not installed, no GPU: one line, exit 2
            raise ValueError(str(exc)) from None
    elif args.transport == "host":
        if args.src_device not in (None, "cpu") or args.dst_device not in (None, "cpu"):
            raise ValueError("the host transport moves cpu memory: leave out the devices")
        result = measure_host(
            args.size_mb, args.block_kb, repeats=args.repeats, num_threads=args.threads
        )
    else:
        from lmd.migration.native import probe_cuda

        probe = probe_cuda()
        if not probe["available"]:
            raise ValueError(f"cuda_ipc needs a GPU: {probe['reason']}")
        try:
            result = measure_cuda_ipc(
                args.size_mb,
                args.block_kb,
                src_device=args.src_device or "cuda:0",
                dst_device=args.dst_device or "cuda:0",
                repeats=args.repeats,
                copy_kernel=not args.direct_copies,
            )
        except RuntimeError as exc:  # no CUDA, no peer access: one line, exit 2
            raise ValueError(str(exc)) from None
    out: dict[str, Any] = dict(result)
    out["vs_local"] = round(out["gbps"] / out["memcpy_gbps"], 3) if out["memcpy_gbps"] else None
    return out


def summary(result: dict[str, Any]) -> str:
    threads = f", {result['threads']} threads" if result["transport"] == "host" else ""
    local = "memcpy" if result["src_device"] == result["dst_device"] == "cpu" else "torch copy"
    return (
        f"{result['transport']} {result['src_device']} -> {result['dst_device']}{threads}: "
        f"{result['bytes'] / 2**20:.0f} MiB in {result['blocks']} blocks, "
        f"{result['seconds'] * 1e3:.3f} ms, {result['gbps']:.1f} GB/s "
        f"({local} of the same bytes: {result['memcpy_gbps']:.1f} GB/s, "
        f"ratio {result['vs_local']})"
    )
