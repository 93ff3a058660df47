"""A batch-1 decode step's products with their input made in the same launch
(kernels/vector_gemv.py: RMSNorm of the residual stream before qkv, gate_up and lm_head)
against what the model runs without it (kernels.rms_norm, then kernels.gemv), at
Llama-3-8B's and Qwen3-8B's shapes, whole and as one rank of two (tensor parallelism).
CUDA only.

    python3 scripts/gemv_bench.py [--dtype bf16] [--shapes llama,llama-tp2,qwen3]
    python3 scripts/gemv_bench.py --plain [--plain-shapes 4096x4096,4096x12288,...]
    python3 scripts/gemv_bench.py --experts
    ... [--tiles 8x1024x8x1,...]     more vector_gemv tilings (BLOCK_N x BLOCK_K x warps x stages)

Each time is the median of CUDA-graph replays over enough copies of the weights to
overflow the L2 cache (scripts/w4a16_tiles.py's time_us); every tiling is checked against
the separate kernels first. Also the plain product (no prologue) of both kernels, to tell
the kernel's own speed from the fusion's. `--plain`: the products that take no norm (o,
down) at one row, gemv's tilings against vector_gemv's, each checked against F.linear.
`--experts`: a layer of experts at one token (kernels/moe_vector.py) at Qwen3-30B-A3B's
shape (128 experts of 768, hidden 2048, top 8): the router's product with its norm and
the choice of the experts in its launch (against the product, then the top-k kernel),
gate|up of the 8 chosen with the activation, down and the mix, each kernel's tilings
(8 other experts chosen in each graph call, so the weights come from HBM).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from lmd.engine.turbo import kernels
from lmd.engine.turbo.kernels import moe_vector, routing
from lmd.engine.turbo.kernels.vector_gemv import Route, default_tiles
from scripts.w4a16_tiles import L2_BYTES, rel_err, time_us

# name -> [(N, K)]: qkv, gate|up and lm_head, each after a norm.
SHAPES = {
    "llama": [(6144, 4096), (28672, 4096), (128256, 4096)],
    "llama-tp2": [(3072, 4096), (14336, 4096), (64128, 4096)],
    "qwen3": [(6144, 4096), (24576, 4096), (151936, 4096)],
    "qwen3moe": [(5120, 2048), (151936, 2048)],
    # gate|up with the activation made in the launch too (TurboModel.fused_activation)
    "llama-gated": [(28672, 4096)],
    "qwen3-gated": [(24576, 4096)],
}
TILES = [  # BLOCK_N, BLOCK_K, warps, stages
    (16, 256, 4, 3), (16, 512, 4, 3), (8, 512, 4, 3), (32, 256, 4, 3), (32, 128, 4, 4),
    (16, 256, 8, 3), (8, 1024, 4, 2), (16, 128, 4, 4), (4, 1024, 4, 3),
]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--shapes", default="llama,llama-tp2,qwen3")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--experts", action="store_true")
    p.add_argument("--plain-shapes", default="4096x4096,4096x12288,4096x14336,2048x4096")
    p.add_argument(
        "--tiles", default="", help="more vector_gemv tilings to try: NxKxWARPSxSTAGES,..."
    )
    args = p.parse_args()
    extra = [tuple(int(d) for d in t.split("x")) for t in filter(None, args.tiles.split(","))]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(torch.cuda.get_device_name(0))
    if args.experts:
        bench_experts(dtype)
        return
    if args.plain:
        for shape in args.plain_shapes.split(","):
            n, k = (int(d) for d in shape.split("x"))
            bench_plain(n, k, dtype, extra)
        return
    for name in args.shapes.split(","):
        total_sep = total_best = 0.0
        for n, k in SHAPES[name]:
            sep, best = bench(n, k, dtype, "silu" if name.endswith("-gated") else None, extra)
            total_sep += sep
            total_best += best
        print(f"{name}: a layer's two + lm_head: separate {total_sep:.1f} us, "
              f"fused best {total_best:.1f} us")  # fmt: skip


def past_l2(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A random [N, K] weight, and it with enough copies to overflow L2 (time_us's calls
    go over them in turn)."""
    dense = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    return dense, [dense] + [dense.clone() for _ in range(max(0, L2_BYTES // dense.nbytes - 1))]


def bench(
    n: int, k: int, dtype: torch.dtype, activation: str | None, extra: list[Any]
) -> tuple[float, float]:
    """Prints one block of rows; returns (separate kernels' us, best fused us). With
    `activation`, the weight is gate | up and the launch makes act(gate) * up. `extra`:
    tilings to try past TILES and PLAIN_TILES (--tiles)."""
    dense, weights = past_l2(n, k, dtype)
    out_dtype = torch.float32 if n > 50000 else None  # lm_head: float32 logits
    hidden = torch.randn(1, k, device="cuda").to(dtype)
    residual = torch.randn(1, k, device="cuda").to(dtype)
    weight = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    stream = residual.clone()  # the separate kernels add into it in place
    summed = torch.empty_like(residual)
    norm = kernels.Norm(weight, 1e-5, residual, summed)

    def separate(w: torch.Tensor) -> torch.Tensor:
        x = kernels.rms_norm(hidden, weight, 1e-5, stream)
        y = kernels.gemv(x, w, out_dtype=out_dtype)
        return y if activation is None else kernels.silu_and_mul(y, activation)

    ref = separate(dense)
    sep_us = time_us([partial(separate, w) for w in weights])
    gemv_us = time_us([partial(kernels.gemv, hidden, w) for w in weights])
    vec_us = time_us([partial(kernels.vector_gemv, hidden, w) for w in weights])
    gb = dense.nbytes / 1e3
    print(f"N={n} K={k}: separate {sep_us:.1f} us; plain gemv {gemv_us:.1f} us "
          f"({gb / gemv_us:.0f} GB/s), plain vector_gemv {vec_us:.1f} us")  # fmt: skip
    fused = partial(
        kernels.vector_gemv, hidden, norm=norm, out_dtype=out_dtype, activation=activation
    )
    rows = []
    for tiles in TILES + PLAIN_TILES + extra:
        if activation is not None and tiles[0] < 2:  # a program makes BLOCK_N / 2 outputs
            continue
        try:
            err = rel_err(fused(dense, tiles=tiles), ref)
            us = time_us([partial(fused, w, tiles=tiles) for w in weights])
        except Exception as exc:  # a tiling that does not compile is a result too
            print(f"  {tiles}: {type(exc).__name__} {str(exc)[:80]}")
            continue
        rows.append((us, tiles, err))
    rows.sort()
    default = default_tiles(n, k, torch.device("cuda"))
    for us, tiles, err in rows[:5] + [row for row in rows[5:] if row[1] == default]:
        flag = " !! ERROR" if err > 2e-2 else ""
        mark = " (default)" if tiles == default else ""
        print(f"  fused {tiles}: {us:8.1f} us {gb / us:6.0f} GB/s x{sep_us / us:5.2f}"
              f"  err {err:.1e}{flag}{mark}")  # fmt: skip
    return sep_us, rows[0][0] if rows else float("nan")


GEMV_TILES = [  # BLOCK_N, BLOCK_K, warps, stages
    (32, 512, 4, 4), (16, 512, 4, 4), (16, 256, 4, 4), (16, 512, 8, 4), (32, 256, 4, 5),
    (16, 1024, 4, 3), (32, 512, 8, 3), (64, 256, 4, 4),
]  # fmt: skip

PLAIN_TILES = [  # vector_gemv's, past TILES
    (2, 2048, 4, 3), (4, 2048, 8, 2), (8, 1024, 8, 3), (4, 512, 4, 4), (2, 1024, 4, 4),
    (1, 4096, 4, 2), (8, 2048, 8, 2),
]  # fmt: skip
MIX_TILES = [  # moe_vector.mix_down's: [8, BLOCK_N, BLOCK_K] accumulators
    (1, 256, 4, 3), (1, 1024, 4, 2), (2, 128, 4, 4), (2, 256, 4, 3), (2, 256, 8, 3),
    (2, 512, 4, 2), (2, 512, 8, 2), (4, 128, 4, 3), (4, 256, 8, 3), (1, 512, 4, 3),
]  # fmt: skip


def bench_plain(n: int, k: int, dtype: torch.dtype, extra: list[Any]) -> None:
    """One row times [N, K]: gemv's tilings and vector_gemv's (TILES, PLAIN_TILES and
    `extra`), fastest first."""
    dense, weights = past_l2(n, k, dtype)
    x = torch.randn(1, k, device="cuda").to(dtype)
    ref = torch.nn.functional.linear(x.float(), dense.float())
    rows = []
    for bn, bk, warps, stages in GEMV_TILES:
        call = partial(kernels.gemv, x, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        rows.append((time_us([partial(call, w) for w in weights]), "gemv", (bn, bk, warps, stages),
                     rel_err(call(dense), ref)))  # fmt: skip
    for tiles in TILES + PLAIN_TILES + extra:
        call = partial(kernels.vector_gemv, x, tiles=tiles)
        rows.append((time_us([partial(call, w) for w in weights]), "vector_gemv", tiles,
                     rel_err(call(dense), ref)))  # fmt: skip
    rows.sort()
    print(f"N={n} K={k} ({dense.nbytes / 1e6:.1f} MB), one row:")
    for us, kernel, tiles, err in rows:
        flag = " !! ERROR" if err > 2e-2 else ""
        print(f"  {kernel:11s} {tiles}: {us:7.2f} us {dense.nbytes / us / 1e3:6.0f} GB/s"
              f"  err {err:.1e}{flag}")  # fmt: skip


def bench_experts(dtype: torch.dtype, num: int = 128, hidden: int = 2048, inner: int = 768) -> None:
    """Prints each of a layer of experts' three products at its tilings, fastest first."""
    gen = torch.Generator().manual_seed(0)
    choices = [torch.randperm(num, generator=gen)[:8].int().cuda() for _ in range(32)]
    router = (torch.randn(num, hidden, device="cuda") / hidden**0.5).to(dtype)
    gate_up = (torch.randn(num, 2 * inner, hidden, device="cuda") / hidden**0.5).to(dtype)
    down = (torch.randn(num, hidden, inner, device="cuda") / inner**0.5).to(dtype)
    x = torch.randn(1, hidden, device="cuda").to(dtype)
    act = torch.randn(8, inner, device="cuda").to(dtype)
    weights = torch.full((8,), 0.125, device="cuda")
    norm = kernels.Norm((1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype), 1e-6)
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    route = Route(count, weights.clone(), choices[0].clone(), True)
    products: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
        "router 128 x 2048 (norm, float32 out), experts chosen": lambda ids, tiles: (
            kernels.vector_gemv(
                x, router, norm=norm, out_dtype=torch.float32, tiles=tiles, route=route
            )
        ),
        "router 128 x 2048, then top-k": lambda ids, tiles: routing.top_k_of(
            kernels.vector_gemv(x, router, norm=norm, out_dtype=torch.float32, tiles=tiles), 8, True
        )[0],
        "gate|up 8 x 1536 x 2048 (norm, activation)": lambda ids, tiles: kernels.vector_gemv(
            x, gate_up, norm=norm, activation="silu", experts=ids, tiles=tiles
        ),
        "down + mix 8 x 2048 x 768": lambda ids, tiles: moe_vector.mix_down(
            act, down, ids, weights, tiles
        ),
    }
    for name, product in products.items():
        ref = product(choices[0], None)
        rows: list[tuple[float, str, float]] = []
        mix = "mix" in name
        options: list[tuple[int, int, int, int] | None] = [
            None, *(MIX_TILES if mix else [*TILES, *PLAIN_TILES])
        ]  # fmt: skip
        for tiles in options:
            if tiles is not None and tiles[0] < 2 and "gate" in name:
                continue
            err = rel_err(product(choices[0], tiles), ref)
            us = time_us([partial(product, ids, tiles) for ids in choices])
            rows.append((us, str(tiles or "default"), err))
        rows.sort()
        print(name)
        for us, label, err in rows[:6] + [r for r in rows[6:] if r[1] == "default"]:
            print(f"  {label}: {us:7.2f} us  err {err:.1e}")
    print(f"the router's counter after the runs: {count.item()} (0 expected)")


if __name__ == "__main__":
    main()
