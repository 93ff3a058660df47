"""The native W4A16 experts kernels (native/kernels/w4a16_experts.cu for blocks of 8 or
16 pairs, and on Hopper w4a16_wgmma.cu's experts entry for 64, through
kernels/w4a16_rows.py native_experts, taken by kernels/moe.py's grouped GEMM) on a GPU:
each pair's row against the float64 product of its expert's dequantized weights (times
its routing weight), every pair written and no other row, gate|up's SiLU in the wgmma
kernel, one token's pairs a block each without sorted ids and their mix in one launch
(`mixed`), every warp count, fused_moe
through them against the Triton grouped GEMM they replace (at Qwen3-30B-A3B's experts'
shape, up to 4,096 tokens; without the wgmma kernel 128-row blocks multiply dequantized
slabs), 8-row blocks at one token, captured in a CUDA graph, and declined where they do
not apply. Skipped without CUDA.

Bound: as the rows kernel's (tests/gpu/test_w4a16_rows_gpu.py): exact products summed in
float32 (the wgmma kernel: each weight rounded once to the dtype, as the Triton tiles),
each group's sum scaled once, so each output is the reference rounded once to the dtype
plus float32 summation error.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import Tensor

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.turbo.kernels import Norm, moe, moe_align, moe_vector, rms_norm, w4a16_rows
from lmd.engine.turbo.kernels.activation import silu_and_mul
from lmd.engine.turbo.kernels.w4a16_rows import native_experts
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.get_device_capability() == (9, 0)  # the wgmma kernel's 64-row blocks
RTOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
ATOL = 1e-4


def experts(shape: tuple[int, int, int], dtype: torch.dtype, seed: int) -> W4A16Experts:
    """E random experts of [N, K], rounded to 4 bits in groups of 128."""
    e, n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weights = torch.randn(e, n, k, device="cuda", generator=gen) / k**0.5
    return W4A16Experts.quantize(weights.to(dtype), 128)


def layout(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> tuple[Tensor, ...]:
    """Random routing: (each pair's expert [P], sorted pairs, each block's expert)."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens * 7 + block_m)
    chosen = torch.rand(num_tokens, num_experts, device="cuda", generator=gen).argsort(dim=1)
    chosen = chosen[:, :top_k].to(torch.int32)
    return (chosen.flatten(), *moe_align.align(chosen, num_experts, block_m))


def reference(
    x: Tensor, w: W4A16Experts, expert: Tensor, row_div: int, *, rounded: bool = False
) -> Tensor:
    """Each pair's row x[p // row_div] W_e^T in float64; `rounded`: W_e's (q - z) * scale
    rounded to x's dtype first, as the wgmma kernel (and the Triton tiles) multiply it."""
    dense = (w.dequantize().to(x.dtype) if rounded else w.dequantize()).double()
    rows = x.double()[torch.arange(expert.numel(), device="cuda") // row_div]
    return torch.einsum("pk,pnk->pn", rows, dense[expert.long()])


def run(
    x: Tensor,
    w: W4A16Experts,
    pairs: tuple[Tensor, Tensor],
    *,
    row_div: int,
    block_m: int,
    weights: Tensor | None = None,
    warps: int | None = None,
    gated: bool = False,
) -> Tensor:
    """native_experts (asserted taken) into a y of NaNs, one row a pair."""
    num_pairs = x.shape[0] * row_div
    width = w.shape[1] // 2 if gated else w.shape[1]
    y = torch.full((num_pairs, width), float("nan"), dtype=x.dtype, device="cuda")
    taken = native_experts(
        x, w.qweight, w.scales, w.zeros, w.group_size, *pairs, y,
        row_div=row_div, block_m=block_m, weights=weights, warps=warps, gated=gated,
    )  # fmt: skip
    assert taken
    torch.cuda.synchronize()
    return y


def assert_close(y: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
    assert not y.isnan().any(), "a pair's row was not written"
    err = (y.double() - ref).abs()
    bound = RTOL[dtype] * ref.abs() + ATOL
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


def needs(block_m: int) -> None:
    if block_m == 64 and not HOPPER:
        pytest.skip("64-row blocks take the wgmma kernel: Hopper only")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_m", [8, 16, 64])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("gate_up", [True, False], ids=["gate_up", "down"])
def test_against_float64(dtype: torch.dtype, block_m: int, num_tokens: int, gate_up: bool) -> None:
    """16 experts, 4 a token: gate|up reads token p // 4 ([T, 512] against [E, 512, 512]);
    down a row a pair ([P, 256] against [E, 512, 256]) times its routing weight. 300
    tokens give an expert ~75 pairs: several blocks, the last one's padding."""
    needs(block_m)
    top_k = 4
    shape = (16, 512, 512) if gate_up else (16, 512, 256)
    w = experts(shape, dtype, seed=num_tokens)
    expert, *pairs = layout(num_tokens, 16, top_k, block_m)
    rows = num_tokens if gate_up else num_tokens * top_k
    x = torch.randn(rows, shape[2], device="cuda").to(dtype)
    row_div = top_k if gate_up else 1
    ref = reference(x, w, expert, row_div, rounded=block_m == 64)
    weights = None
    if not gate_up:
        weights = torch.rand(num_tokens * top_k, device="cuda")
        ref = ref * weights.double()[:, None]
    y = run(x, w, (pairs[0], pairs[1]), row_div=row_div, block_m=block_m, weights=weights)
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_m", [8, 16, 64])
@pytest.mark.parametrize("num_tokens", [5, 300])
def test_gate_up_with_its_silu_in_the_launch(
    dtype: torch.dtype, block_m: int, num_tokens: int
) -> None:
    """gated blocks: silu(gate) * up of each pair's two products, each rounded to the
    dtype first, as the plain product and silu_and_mul make it (within a rounding: the
    kernels' exp is __expf)."""
    needs(block_m)
    w = experts((16, 512, 512), dtype, seed=num_tokens)
    _, *pairs = layout(num_tokens, 16, 4, block_m)
    x = torch.randn(num_tokens, 512, device="cuda").to(dtype)
    plain = run(x, w, (pairs[0], pairs[1]), row_div=4, block_m=block_m)
    y = run(x, w, (pairs[0], pairs[1]), row_div=4, block_m=block_m, gated=True)
    expected = silu_and_mul(plain).double()
    err = (y.double() - expected).abs()
    assert bool((err <= 2 * RTOL[dtype] * expected.abs() + ATOL).all()), err.max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_token_a_block_a_pair(dtype: torch.dtype) -> None:
    """No sorted ids (fused_moe's one token): block p holds pair p alone, its expert
    block_expert[p]; gate|up reads the token for each of its 8 pairs, and gated gives
    silu_and_mul of that."""
    w = experts((128, 1536, 2048), dtype, seed=11)
    chosen = torch.randperm(128, device="cuda")[:8].to(torch.int32)
    x = torch.randn(1, 2048, device="cuda").to(dtype)
    y = torch.full((8, 1536), float("nan"), dtype=dtype, device="cuda")
    assert native_experts(x, w.qweight, w.scales, w.zeros, 128, None, chosen, y, row_div=8,
                          block_m=8)  # fmt: skip
    torch.cuda.synchronize()
    assert_close(y, reference(x, w, chosen, 8), dtype)
    act = torch.full((8, 768), float("nan"), dtype=dtype, device="cuda")
    assert native_experts(x, w.qweight, w.scales, w.zeros, 128, None, chosen, act, row_div=8,
                          block_m=8, gated=True)  # fmt: skip
    expected = silu_and_mul(y).double()
    err = (act.double() - expected).abs()
    assert bool((err <= 2 * RTOL[dtype] * expected.abs() + ATOL).all()), err.max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("top_k", "k", "warps"),
    [(8, 768, None), (8, 768, 1), (2, 1024, None), (16, 256, 2), (3, 640, 5), (1, 384, 3)],
)
def test_one_tokens_mix_in_the_launch(
    dtype: torch.dtype, top_k: int, k: int, warps: int | None
) -> None:
    """`mixed`: y [1, N] = the token's pairs' products times their weights, each rounded
    to the dtype, summed in float32 in pair order and rounded once: the unmixed rows
    summed so, each term within a rounding of them (a pair's warps sum K in another
    order); `warps` a two pairs' (an odd count's last warps read the first of theirs
    twice)."""
    w = experts((32, 256, k), dtype, seed=top_k + k)
    chosen = torch.randperm(32, device="cuda")[:top_k].to(torch.int32)
    x = torch.randn(top_k, k, device="cuda").to(dtype)
    weights = torch.rand(top_k, device="cuda")
    parts = (w.qweight, w.scales, w.zeros, 128, None, chosen)
    rows = torch.full((top_k, 256), float("nan"), dtype=dtype, device="cuda")
    assert native_experts(x, *parts, rows, row_div=1, block_m=8, weights=weights)
    y = torch.full((1, 256), float("nan"), dtype=dtype, device="cuda")
    assert native_experts(x, *parts, y, row_div=1, block_m=8, weights=weights, warps=warps,
                          mixed=True)  # fmt: skip
    torch.cuda.synchronize()
    expected = torch.zeros(256, device="cuda")
    for row in rows.float():
        expected += row
    bound = 2 * RTOL[dtype] * (rows.float().abs().sum(0) + expected.abs()) + ATOL
    assert bool(((y[0].float() - expected).abs() <= bound).all())
    terms = reference(x, w, chosen, 1) * weights.double()[:, None]  # float64
    err = (y[0].double() - terms.sum(0)).abs()
    assert bool((err <= 2 * RTOL[dtype] * terms.abs().sum(0) + ATOL).all())


@pytest.mark.parametrize("warps", [1, 2, 3, 4, 8])
def test_every_warp_count(warps: int) -> None:
    """K of 8 blocks of 128 split over 1-8 warps: the same sums."""
    w = experts((8, 256, 1024), torch.bfloat16, seed=warps)
    expert, *pairs = layout(10, 8, 2, 16)
    x = torch.randn(10, 1024, device="cuda").to(torch.bfloat16)
    y = run(x, w, (pairs[0], pairs[1]), row_div=2, block_m=16, warps=warps)
    assert_close(y, reference(x, w, expert, 2), torch.bfloat16)


def test_strided_rows() -> None:
    """x a view whose rows are apart by more than K (a slice of a wider buffer)."""
    w = experts((4, 128, 256), torch.float16, seed=3)
    expert, *pairs = layout(5, 4, 2, 8)
    wide = torch.randn(5, 384, device="cuda").to(torch.float16)
    x = wide[:, 64:320]
    y = run(x, w, (pairs[0], pairs[1]), row_div=2, block_m=8)
    assert_close(y, reference(x, w, expert, 2), torch.float16)


def qwen3_moe_experts(seed: int) -> tuple[W4A16Experts, W4A16Experts, Tensor]:
    """Qwen3-30B-A3B's experts (128, hidden 2,048, width 768), 4-bit, and router: seeded,
    and scaled as the experts so that the logits are O(1) (unscaled, ~45 apart: the
    softmax's weights then move by whole percents with the logits' last bits, and the
    router-that-chooses test failed on a draw where fused_moe's GEMM and vector_gemv's
    logits differed so)."""
    gate_up = experts((128, 1536, 2048), torch.bfloat16, seed)
    down = experts((128, 2048, 768), torch.bfloat16, seed + 1)
    gen = torch.Generator(device="cuda").manual_seed(seed + 2)
    router = torch.randn(128, 2048, device="cuda", generator=gen) / 2048**0.5
    return gate_up, down, router.to(torch.bfloat16)


FUSED_CASES = [(1, True), (8, True), (64, True), (256, True), (300, True), (1024, True)]


@pytest.mark.parametrize(("num_tokens", "wgmma"), [*FUSED_CASES, (4096, True), (4096, False)])
def test_fused_moe_agrees_with_the_triton_kernel(
    monkeypatch: pytest.MonkeyPatch, num_tokens: int, wgmma: bool
) -> None:
    """A layer of Qwen3-30B-A3B's 4-bit experts through the native kernels (from 257
    tokens 64-row blocks on Hopper; with w4a16_rows.WGMMA_EXPERTS off or on another GPU
    Triton tiles and, at 4,096 tokens, dequantized slabs) and through the Triton grouped
    GEMM's 4-bit tiles they replace (w4a16_rows.EXPERTS off; moe.W4_DEQUANT_ROWS past
    128): the same routing, products in float32 either way, so within bf16 rounding of
    each other."""
    gate_up, down, router = qwen3_moe_experts(num_tokens)
    h = torch.randn(num_tokens, 2048, device="cuda").to(torch.bfloat16)
    call = partial(moe.fused_moe, top_k=8, normalize=True, float_out=True)
    monkeypatch.setattr(w4a16_rows, "WGMMA_EXPERTS", wgmma)
    native = call(h, router, gate_up, down)
    monkeypatch.setattr(w4a16_rows, "EXPERTS", False)
    monkeypatch.setattr(moe, "W4_DEQUANT_ROWS", 256)
    triton_out = call(h, router, gate_up, down)
    err = (native.float() - triton_out.float()).abs().max().item()
    assert err <= 2.0**-6 * triton_out.float().abs().max().item(), err


def test_the_blocks_the_native_kernels_take() -> None:
    """8 rows at one token, 64 (Hopper) past 16 pairs an expert; neither for float32 or
    an x the kernels cannot read (2-byte aligned: 16 rows' Triton tiles; 8-byte aligned:
    not the wgmma kernel's 16-byte copies)."""
    gate_up, down, _ = qwen3_moe_experts(0)
    h = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    native = moe_align.native_blocks(h, gate_up, down)
    assert native == ((8, 16, 64) if HOPPER else (8, 16))
    assert moe_align.block_rows(8, 128, native=native) == 8
    assert moe_align.block_rows(8 * 32, 128, native=native) == 8  # 2 pairs an expert
    assert moe_align.block_rows(8 * 64, 128, native=native) == 16  # 4: some would take 2 blocks
    assert moe_align.block_rows(8 * 300, 128, native=native) == (64 if HOPPER else 32)
    assert moe_align.block_rows(8 * 128, 128, native=native) == (64 if HOPPER else 16)  # 8
    assert moe_align.native_blocks(h.float(), gate_up, down) == ()
    odd = torch.randn(1, 2050, device="cuda").to(torch.bfloat16)[:, 1:2049]  # 2-byte aligned
    assert moe_align.native_blocks(odd, gate_up, down) == ()
    assert moe_align.block_rows(8, 128, native=moe_align.native_blocks(odd, gate_up, down)) == 16
    eight = torch.randn(1, 2052, device="cuda").to(torch.bfloat16)[:, 4:2052]  # 8-byte
    assert moe_align.native_blocks(eight, gate_up, down) == (8, 16)


@pytest.mark.parametrize("normalize", [True, False])
def test_one_token_through_the_router_that_chooses(normalize: bool) -> None:
    """moe_vector.experts_vector on 4-bit experts (the router's launch choosing the 8
    experts and writing their normed input, then gate|up a block a pair and down's mix,
    in a CUDA graph): what rms_norm and
    fused_moe give, within bf16 rounding (the sum over k in another order), and the
    residual stream's sum written."""
    gate_up, down, router = qwen3_moe_experts(21)
    gen = torch.Generator(device="cuda").manual_seed(21)
    hidden, residual = (torch.randn(1, 2048, device="cuda", generator=gen) for _ in range(2))
    hidden, residual = hidden.to(torch.bfloat16), residual.to(torch.bfloat16)
    weight = (1 + 0.2 * torch.randn(2048, device="cuda", generator=gen)).to(torch.bfloat16)
    assert 8 in moe_align.native_blocks(hidden, gate_up, down)
    summed = torch.empty_like(residual)
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    call = partial(moe_vector.experts_vector, hidden, Norm(weight, 1e-6, residual, summed),
                   router, gate_up, down, top_k=8, normalize=normalize, count=count)  # fmt: skip
    call()  # warm: Triton compiles outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    assert count.item() == 0
    assert torch.equal(summed, (hidden.float() + residual.float()).to(torch.bfloat16))
    h = rms_norm(hidden, weight, 1e-6, residual.clone())
    ref = moe.fused_moe(h, router, gate_up, down, top_k=8, normalize=normalize, float_out=True)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2.0**-6 * ref.float().abs().max().item(), err


@pytest.mark.parametrize("num_tokens", [4, 300])
def test_captured_in_a_cuda_graph(num_tokens: int) -> None:
    """8-row blocks (4 tokens) and, on Hopper, the wgmma kernel's 64 (300)."""
    gate_up, down, router = qwen3_moe_experts(5)
    h = torch.randn(num_tokens, 2048, device="cuda").to(torch.bfloat16)
    call = partial(moe.fused_moe, top_k=8, normalize=True, float_out=True)
    call(h, router, gate_up, down)  # warm: Triton compiles outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(h, router, gate_up, down)
    h.copy_(torch.randn(num_tokens, 2048, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, call(h, router, gate_up, down))


def test_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of 64, float32, 32-row blocks, int64 pairs, gated with routing weights or
    into a y of gate|up's width, 64-row blocks without sorted pairs or (off Hopper) at all, and
    EXPERTS off: False, y untouched; an 8-row block the Triton kernel cannot take is an
    error then."""
    w = experts((4, 128, 256), torch.bfloat16, seed=9)
    expert, *pairs = layout(3, 4, 2, 16)
    x = torch.randn(3, 256, device="cuda").to(torch.bfloat16)
    y = torch.zeros(6, 128, dtype=torch.bfloat16, device="cuda")
    parts = (w.qweight, w.scales, w.zeros)
    sixty_four = W4A16Experts.quantize(w.dequantize().to(torch.bfloat16), 64)
    declined = [
        native_experts(x, sixty_four.qweight, sixty_four.scales, sixty_four.zeros, 64,
                       pairs[0], pairs[1], y, row_div=2, block_m=16),
        native_experts(x.float(), *parts, 128, pairs[0], pairs[1], y.float(), row_div=2,
                       block_m=16),
        native_experts(x, *parts, 128, pairs[0], pairs[1], y, row_div=2, block_m=32),
        native_experts(x, *parts, 128, pairs[0].long(), pairs[1], y, row_div=2, block_m=16),
    ]  # fmt: skip
    _, *rows64 = layout(3, 4, 2, 64)
    half = torch.zeros(6, 64, dtype=torch.bfloat16, device="cuda")  # a gated product's
    declined += [
        native_experts(x, *parts, 128, pairs[0], pairs[1], y, row_div=2, block_m=16,
                       gated=True),
        native_experts(x, *parts, 128, pairs[0], pairs[1], half, row_div=2, block_m=16,
                       weights=torch.ones(6, device="cuda"), gated=True),
        native_experts(x, *parts, 128, rows64[0], rows64[1], half, row_div=2, block_m=64,
                       weights=torch.ones(6, device="cuda"), gated=True),
        native_experts(x, *parts, 128, None, rows64[1], y, row_div=2, block_m=64),
    ]  # fmt: skip
    if not HOPPER:
        declined.append(
            native_experts(x, *parts, 128, rows64[0], rows64[1], y, row_div=2, block_m=64)
        )
    one = torch.zeros(1, 128, dtype=torch.bfloat16, device="cuda")  # a token's mix
    ones, many = torch.ones(6, device="cuda"), torch.zeros(17, dtype=torch.int32, device="cuda")
    declined += [
        native_experts(x, *parts, 128, pairs[0], pairs[1], one, row_div=2, block_m=8,
                       weights=ones, mixed=True),  # sorted pairs
        native_experts(x, *parts, 128, None, expert, one, row_div=2, block_m=8, mixed=True),
        native_experts(x, *parts, 128, None, expert, one, row_div=2, block_m=16,
                       weights=ones, mixed=True),
        native_experts(x, *parts, 128, None, many, one, row_div=6, block_m=8,
                       weights=torch.ones(17, device="cuda"), mixed=True),  # 17 pairs
    ]  # fmt: skip
    monkeypatch.setattr(w4a16_rows, "EXPERTS", False)
    declined.append(native_experts(x, *parts, 128, pairs[0], pairs[1], y, row_div=2, block_m=16))
    assert not any(declined) and not y.any() and not half.any() and not one.any()
    _, *eight = layout(3, 4, 2, 8)
    with pytest.raises(ValueError, match="blocks of 8 rows take the native"):
        moe.grouped_gemm(x, w, eight[0], eight[1], num_pairs=6, a_row_div=2, block_m=8)
    assert expert.numel() == 6
