"""Decode attention over a bf16, an int8 and an fp8 (e4m3) KV pool (kernels/kv_quant.py)
at Llama-3-8B's heads: time per call and the KV bytes it reads per second.

    python3 scripts/kv_quant_bench.py [--batches 1,64,256] [--context 1024] [--orders]
                                      [--splits 2,4,8] [--sweep] [--rotary]

CUDA only. Each sequence holds `context` tokens in shuffled blocks of one layer; q is
bf16. "eager" is the mean of `--iters` back-to-back launches between two CUDA events
(Python launch overhead included); "graph" replays those launches captured in a CUDA
graph (kernel time alone). GB/s counts the K and V bytes (and scales) of the context;
speedup is the graph time of the first kind listed over this one's. `--rotary`: also the
rotary and the new token's K/V write (q the heads of qkv rows) in a launch of its own
before the attention, and in the attention's launch (`decode_attention(rotary=)`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

from lmd.engine.turbo import kernels
from lmd.engine.turbo.kernels import kv_quant
from lmd.engine.turbo.rope import table_of


def time_us(fn: Callable[[], object], iters: int, graphed: bool) -> float:
    """Mean microseconds per call of fn, over iters calls between CUDA events."""
    for _ in range(3):  # compile, warm the caches
        fn()
    torch.cuda.synchronize()
    run = fn
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        run = graph.replay
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    if graphed:
        run()
    else:
        for _ in range(iters):
            run()
    end.record()
    torch.cuda.synchronize()
    ms: float = start.elapsed_time(end)
    return ms * 1e3 / iters


def make_pool(
    kind: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(kv, kv_scales or None, bytes per token per layer) of one layer of random K/V."""
    values = torch.randn(num_blocks, 1, 2, block_size, kv_heads, head_dim, device="cuda")
    if kind == "bf16":
        return values.to(torch.bfloat16), None, 2 * kv_heads * head_dim * 2
    _, kv, scales = kv_quant.quantized_pool(
        num_blocks, 1, block_size, kv_heads, head_dim, kind, "cuda"
    )
    codes, s = kv_quant.quantize_heads(values, kind)
    kv.copy_(codes)
    scales.copy_(s)
    return kv, scales, 2 * kv_heads * (head_dim + 2)


# (keys per tile, warps, stages) tried by --sweep
SWEEP = [(bn, w, s) for bn in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4)]


def variant(label: str, call: Callable[..., object], iters: int, nbytes: int, base: float) -> None:
    """One more row: `call`'s graph time, GB/s and speedup, under the first kind's row."""
    us = time_us(call, iters, graphed=True)
    print(f"{label:>28} {us:>9.1f} {nbytes / us / 1e3:>7.0f} {base / us:>7.2f}x")


def sweep(call: Callable[..., object], iters: int, nbytes: int, base: float) -> None:
    """Graph time of every tiling in SWEEP, fastest first, the same call otherwise."""
    rows = []
    ref = call().float()  # type: ignore[attr-defined]
    for tiles in SWEEP:
        try:
            err = float((call(tiles=tiles).float() - ref).norm() / ref.norm())  # type: ignore[attr-defined]
            if err > 1e-2:
                print(f"      tiles {tiles}: WRONG, rel err {err:.1e}")
                continue
            us = time_us(partial(call, tiles=tiles), iters, graphed=True)
        except Exception as exc:  # a tiling that does not compile is a result too
            print(f"      tiles {tiles}: {type(exc).__name__} {str(exc)[:80]}")
            continue
        rows.append((us, tiles))
    for us, tiles in sorted(rows)[:6]:
        print(f"      tiles {tiles}: {us:9.1f} us {nbytes / us / 1e3:7.0f} GB/s {base / us:6.2f}x")


def rotary_variants(  # noqa: PLR0917  # the case's parts, as main has them
    call: partial[torch.Tensor],
    args: argparse.Namespace,
    tables: torch.Tensor,
    kv: torch.Tensor,
    scales: torch.Tensor | None,
    nbytes: int,
    base: float,
) -> None:
    """Two rows: the rotary's launch then the attention, and the attention doing it."""
    batch, d = tables.shape[0], args.head_dim
    rows = torch.randn(batch, (args.heads + 2 * args.kv_heads) * d, device="cuda")
    rows = rows.to(torch.bfloat16)
    last = args.context - 1  # the new token: its position and slot
    slots = tables[:, last // args.block_size].long() * args.block_size + last % args.block_size
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2) / d)  # Llama's default base
    rotary = kernels.Rotary(
        torch.full((batch,), last, device="cuda"), slots,
        table_of(inv_freq, 1.0, args.context, torch.device("cuda")), kv, 0, args.heads,
        kv_scales=scales,
    )  # fmt: skip
    attend = partial(kernels.decode_attention, rows.view(batch, -1, d)[:, : args.heads], kv,
                     **call.keywords)  # fmt: skip

    def apart() -> object:
        rotary.apply(rows)
        return attend()

    variant("rotary's launch first", apart, args.iters, nbytes, base)
    variant("rotary in the launch", partial(attend, rotary=rotary), args.iters, nbytes, base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--kinds", default="bf16,int8,fp8")
    parser.add_argument(
        "--orders", action="store_true", help="also the grid (B, Hkv) order (graph)"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also every tiling of SWEEP (graph times)"
    )
    parser.add_argument("--splits", default="", help="also these split counts, e.g. 2,4,8")
    parser.add_argument(
        "--rotary", action="store_true", help="also with the rotary, apart and in the launch"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kv_quant_bench needs a CUDA device")
    torch.manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: H={args.heads} Hkv={args.kv_heads} "
          f"D={args.head_dim} S={args.block_size} context={args.context}")  # fmt: skip
    print(f"{'batch':>5} {'kv':>5} {'splits':>6} {'eager us':>9} {'graph us':>9} "
          f"{'GB/s':>7} {'speedup':>8}")  # fmt: skip
    for batch in (int(b) for b in args.batches.split(",")):
        per_seq = -(-args.context // args.block_size)
        num_blocks = batch * per_seq
        tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, per_seq)
        lens = torch.full((batch,), args.context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
        splits = kernels.decode_splits(batch, args.kv_heads, args.context, num_sms)
        base = 0.0
        for kind in args.kinds.split(","):
            kv, scales, token_bytes = make_pool(
                kind, num_blocks, args.block_size, args.kv_heads, args.head_dim
            )
            call = partial(
                kernels.decode_attention, q, kv, layer=0, block_tables=tables,
                context_lens=lens, scale=args.head_dim**-0.5, num_splits=splits,
                kv_scales=scales,
            )  # fmt: skip
            nbytes = batch * args.context * token_bytes
            eager = time_us(call, args.iters, graphed=False)
            graph = time_us(call, args.iters, graphed=True)
            base = base or graph
            print(f"{batch:>5} {kind:>5} {splits:>6} {eager:>9.1f} {graph:>9.1f} "
                  f"{nbytes / graph / 1e3:>7.0f} {base / graph:>7.2f}x")  # fmt: skip
            for more in (int(x) for x in args.splits.split(",") if x):
                row = f"{more:>6}{'':>10}"
                variant(row, partial(call, num_splits=more), args.iters, nbytes, base)
            if args.orders:  # sequences first, a sequence's KV heads far apart
                variant("seqs first", partial(call, heads_first=False), args.iters, nbytes, base)
            if args.sweep:
                sweep(call, args.iters, nbytes, base)
            if args.rotary:
                rotary_variants(call, args, tables, kv, scales, nbytes, base)
            del kv, scales


if __name__ == "__main__":
    main()
