"""What asking L2 for a product's weights ahead of it saves (kernels/l2_prefetch.py): a
batch-1 product after a gap in which the memory bus idles (a kernel that only spins,
standing for rotary and decode attention), with and without the weights asked for at
the start of the gap. CUDA (sm_90) only.

    python3 scripts/l2_prefetch_bench.py [--shapes 4096x4096,2048x4096]
        [--gaps 0,4000,8000,16000] [--chunks 4096,16384,65536]

Each time is the median of CUDA-graph replays over enough copies of the weights to
overflow L2 (scripts/w4a16_tiles.py's time_us), in microseconds a copy: the gap alone,
the product alone, gap + product, and prefetch + gap + product for each chunk size.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from lmd.engine.turbo import kernels
from lmd.engine.turbo.kernels.l2_prefetch import prefetch_l2
from scripts.w4a16_tiles import L2_BYTES, time_us


def gap(cycles: int) -> None:
    if cycles:
        torch.cuda._sleep(cycles)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="4096x4096,2048x4096")
    p.add_argument("--gaps", default="0,4000,8000,16000")
    p.add_argument("--chunks", default="4096,16384,65536")
    args = p.parse_args()
    print(torch.cuda.get_device_name(0))
    gaps = [int(g) for g in args.gaps.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    for shape in args.shapes.split(","):
        n, k = (int(d) for d in shape.split("x"))
        dense = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        weights = [dense] + [dense.clone() for _ in range(max(0, L2_BYTES // dense.nbytes - 1))]
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        alone = time_us([partial(kernels.gemv, x, w) for w in weights])
        print(f"o {n} x {k} ({dense.nbytes / 1e6:.1f} MB): product alone {alone:.2f} us "
              f"({dense.nbytes / alone / 1e6:.0f} GB/s)")  # fmt: skip
        for cycles in gaps:

            def plain(w: torch.Tensor, cycles: int = cycles, x: torch.Tensor = x) -> None:
                gap(cycles)
                kernels.gemv(x, w)

            def ahead(
                w: torch.Tensor, chunk: int, cycles: int = cycles, x: torch.Tensor = x
            ) -> None:
                prefetch_l2(w, chunk=chunk)
                gap(cycles)
                kernels.gemv(x, w)

            idle = time_us([partial(gap, cycles) for _ in weights]) if cycles else 0.0
            both = time_us([partial(plain, w) for w in weights])
            row = [f"gap {cycles} cycles ({idle:.2f} us): gap + product {both:.2f} us"]
            for chunk in chunks:
                t = time_us([partial(ahead, w, chunk) for w in weights])
                row.append(f"prefetch {chunk >> 10} KiB {t:.2f} us ({both - t:+.2f})")
            print("  " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
