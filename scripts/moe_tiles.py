"""The grouped GEMMs of a layer of experts (kernels/moe.py) at Qwen3-30B-A3B's shape over
a few tilings, at decode and prefill sizes: which tiles to take where.

    python3 scripts/moe_tiles.py [--tokens 1,8,64,256,4096] [--fp8 rows|blocks]
        [--codes-rows N] [--w4a16 GROUP] [--w4-rows N] [--expert-warps 2,4,8] [--no-native]
        [--profile] [--dequant-rows N] [--torch-sum]

Random bf16 inputs, E = 128 experts, k = 8, hidden 2,048, I = 768; with --fp8 the experts
quantized (quant/fp8_experts.py: a scale a row, or 128x128 blocks), with --w4a16 rounded
to 4 bits in groups of GROUP (quant/w4a16_experts.py; tiles' BLOCK_K is then 128), blocks
of up to --w4-rows rows in the decode form (moe.W4_SCALE_AFTER_ROWS); blocks of up to 16
rows take the native experts kernel on the default tiles (kernels/w4a16_rows.py; with
--expert-warps it is timed at each count of warps a CTA instead of the Triton tilings,
which take 16-row blocks and up; --no-native: the Triton kernel for all; --profile: the
kernels of eager fused_moe calls under torch.profiler, a call's each; blocks of
--dequant-rows rows and more multiply dequantized slabs, moe.W4_DEQUANT_ROWS; --torch-sum:
the sum over k by torch, moe_sum.TRITON_SUM off). Times are
`triton.testing.do_bench_cudagraph` medians (no launch overhead), with the bytes of the
experts the tokens hit over that time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
import triton
from tp_step import kernel_table, print_kernels  # scripts/ is this script's import path

from lmd.engine.turbo.kernels import moe, moe_align, moe_sum, routing, w4a16_rows
from lmd.engine.turbo.quant.fp8_experts import Fp8Experts
from lmd.engine.turbo.quant.load import Experts
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts

E, K, HIDDEN, INTER = 128, 8, 2048, 768
TILES = [None, (32, 128, 4, 3), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 3),
         (32, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3), (16, 256, 4, 4),
         (128, 64, 8, 3), (256, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3),
         (256, 64, 8, 4), (256, 32, 8, 4), (128, 128, 8, 4), (128, 64, 8, 4)]  # fmt: skip


def bench(fn: Callable[[], object]) -> float:
    """Median microseconds of fn inside a CUDA graph."""
    return float(triton.testing.do_bench_cudagraph(fn)) * 1e3


def calls(layer: Callable[[], object], _: int) -> None:
    """kernel_table's step: one call of the layer."""
    layer()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="1,8,64,256,4096")
    parser.add_argument(
        "--block-m", type=int, default=0, help="rows per block (default: moe_align.block_rows)"
    )
    parser.add_argument("--fp8", choices=["rows", "blocks"], default=None)
    parser.add_argument("--w4a16", type=int, default=0, help="4-bit experts in groups of this")
    parser.add_argument("--w4-rows", type=int, default=-1, help="moe.W4_SCALE_AFTER_ROWS")
    parser.add_argument(
        "--codes-rows", type=int, default=0, help="moe.FP8_CODES_ROWS (default: as it is)"
    )
    parser.add_argument("--expert-warps", default="", help="w4a16_rows.EXPERT_WARPS to try")
    parser.add_argument("--no-native", action="store_true", help="w4a16_rows.EXPERTS off")
    parser.add_argument(
        "--no-wgmma", action="store_true", help="w4a16_rows.WGMMA_EXPERTS off (64-row blocks)"
    )
    parser.add_argument("--wgmma-past", type=int, default=-1, help="moe_align.WGMMA_PAST")
    parser.add_argument("--profile", action="store_true", help="fused_moe's kernels, eager")
    parser.add_argument("--torch-sum", action="store_true", help="moe_sum.TRITON_SUM off")
    parser.add_argument("--dequant-rows", type=int, default=0, help="moe.W4_DEQUANT_ROWS")
    return parser.parse_args()


def set_switches(args: argparse.Namespace) -> None:
    """The kernels' module switches as the flags ask."""
    w4a16_rows.EXPERTS = not args.no_native
    moe_sum.TRITON_SUM = not args.torch_sum
    w4a16_rows.WGMMA_EXPERTS = not args.no_wgmma
    if args.wgmma_past >= 0:
        moe_align.WGMMA_PAST = args.wgmma_past
    moe.W4_DEQUANT_ROWS = args.dequant_rows or moe.W4_DEQUANT_ROWS
    moe.FP8_CODES_ROWS = args.codes_rows or moe.FP8_CODES_ROWS
    if args.w4_rows >= 0:
        moe.W4_SCALE_AFTER_ROWS = args.w4_rows


def main() -> None:
    args = parse()
    set_switches(args)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    router = torch.randn(E, HIDDEN, device=dev, dtype=torch.bfloat16)
    gate_up: Experts
    down: Experts
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) / 32
    down = torch.randn(E, HIDDEN, INTER, device=dev, dtype=torch.bfloat16) / 32
    expert_bytes = (2 * INTER * HIDDEN + HIDDEN * INTER) * (1 if args.fp8 else 2)
    if args.fp8:
        blocks = (128, 128) if args.fp8 == "blocks" else None
        gate_up, down = (Fp8Experts.quantize(t, t.dtype, blocks) for t in (gate_up, down))
    elif args.w4a16:
        gate_up, down = (W4A16Experts.quantize(t, args.w4a16) for t in (gate_up, down))
        expert_bytes //= 4
    for tokens in (int(t) for t in args.tokens.split(",")):
        h = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
        weights, experts = routing.route(h, router, K, True, float_out=True)
        gb = int(torch.unique(experts).numel()) * expert_bytes / 1e3  # in kB: GB/s from us
        native = moe_align.native_blocks(h, gate_up, down)
        block_m = args.block_m or moe_align.block_rows(tokens * K, E, native=native)
        layout = moe_align.align(experts, E, block_m)
        act = torch.randn(tokens * K, INTER, device=dev, dtype=torch.bfloat16)
        h_in, h_scale = moe.fp8_input(h, gate_up, block_m)  # codes past FP8_CODES_ROWS
        act_in, act_scale = moe.fp8_input(act, down, block_m)
        layer = partial(moe.fused_moe, h, router, gate_up, down, top_k=K, normalize=True,
                        float_out=True)  # fmt: skip
        whole = bench(layer)
        print(f"T={tokens}: block_m {block_m}, fused_moe {whole:.1f} us, "
              f"{gb / whole:.0f} GB/s of the experts hit")  # fmt: skip
        if args.profile:
            print_kernels(kernel_table(partial(calls, layer), 20), 12, whole / 1e3)
        pairs = tokens * K
        gemms = partial(both_gemms, h_in, act_in, gate_up, down, layout, weights.flatten(),
                        block_m=block_m, pairs=pairs, h_scale=h_scale,
                        act_scale=act_scale)  # fmt: skip
        for warps in [int(w) for w in args.expert_warps.split(",") if w]:
            w4a16_rows.EXPERT_WARPS = warps
            up, dn = gemms(None)
            print(f"  native, {warps} warps: gate_up {up:.1f} us, down {dn:.1f} us, "
                  f"{gb / (up + dn):.0f} GB/s")  # fmt: skip
        w4a16_rows.EXPERT_WARPS = None  # the next fused_moe at its default
        sweep = block_m >= 16 and not (args.expert_warps or args.profile)
        for tiles in TILES if sweep else []:
            try:
                up, dn = gemms(tiles)
            except Exception as exc:  # a tiling that does not compile is a result too
                print(f"  tiles {tiles}: {type(exc).__name__} {str(exc)[:80]}")
                continue
            print(f"  tiles {tiles or 'default'}: gate_up {up:.1f} us, down {dn:.1f} us, "
                  f"{gb / (up + dn):.0f} GB/s")  # fmt: skip


def both_gemms(  # noqa: PLR0917  # what a layer's two grouped GEMMs take
    h_in: torch.Tensor,
    act_in: torch.Tensor,
    gate_up: Experts,
    down: Experts,
    layout: tuple[torch.Tensor, torch.Tensor],
    routed: torch.Tensor,
    tiles: tuple[int, int, int, int] | None,
    *,
    block_m: int,
    pairs: int,
    h_scale: torch.Tensor | None,
    act_scale: torch.Tensor | None,
) -> tuple[float, float]:
    """gate|up (with its activation under GATED_GEMM, as the model runs it) and down
    (times the routing weights) at `tiles`, microseconds each."""
    up = bench(partial(moe.grouped_gemm, h_in, gate_up, *layout, a_row_div=K, tiles=tiles,
                       num_pairs=pairs, block_m=block_m, gated=moe.GATED_GEMM,
                       a_scale=h_scale))  # fmt: skip
    dn = bench(partial(moe.grouped_gemm, act_in, down, *layout, a_row_div=1, scale=routed,
                       tiles=tiles, num_pairs=pairs, block_m=block_m,
                       a_scale=act_scale))  # fmt: skip
    return up, dn


if __name__ == "__main__":
    main()
