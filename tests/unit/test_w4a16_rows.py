"""The native W4A16 decode kernels' host side (engine/turbo/kernels/w4a16_rows.py,
lmd._native.w4a16_rows, w4a16_wide, w4a16_wgmma and w4a16_experts) on a machine without
a GPU: the warps and splits they pick and their argument checks before any CUDA call.
Their PTX is test_native_ptx.py's, their products tests/gpu/test_w4a16_rows_gpu.py's and
test_w4a16_experts_gpu.py's."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from lmd import _native
from lmd.engine.turbo.kernels import w4a16_rows
from lmd.engine.turbo.kernels.vector_gemv import Norm
from lmd.engine.turbo.kernels.w4a16_normed import native_normed
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts

LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate|up": (28672, 4096),
    "down": (4096, 14336),
}


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (1, {"qkv": 8, "o": 16, "gate|up": 4, "down": 16}),
        (16, {"qkv": 4, "o": 8, "gate|up": 4, "down": 8}),
    ],
)
def test_warps_keep_one_wave_resident_on_132_sms(rows: int, expected: dict[str, int]) -> None:
    """The counts measured best on an H200 (the function's docstring) for Llama-3-8B."""
    got = {name: w4a16_rows.default_warps(rows, n, k, 132) for name, (n, k) in LLAMA3_8B.items()}
    assert got == expected


def test_warps_never_exceed_the_blocks_of_k_or_the_registers() -> None:
    assert w4a16_rows.default_warps(1, 32, 128, 132) == 1  # one block of K
    assert w4a16_rows.default_warps(1, 32, 512, 132) == 4
    assert w4a16_rows.default_warps(16, 32, 1 << 16, 132) == 8  # 16 rows: 8 warps at most
    assert w4a16_rows.default_warps(1, 128256, 4096, 132) == 4  # an lm_head: several waves


def test_splits_give_two_ctas_a_multiprocessor() -> None:
    got = {name: w4a16_rows.default_splits(n, k, 132) for name, (n, k) in LLAMA3_8B.items()}
    assert got == {"qkv": 5, "o": 8, "gate|up": 1, "down": 8}
    assert w4a16_rows.default_splits(96, 256, 132) == 2  # at most a block of K each
    assert w4a16_rows.default_splits(128256, 4096, 132) == 1


def test_wgmma_splits_keep_every_cta_resident() -> None:
    """Spans of 256: the most splits whose CTAs all run at once (w4a16_wgmma_ctas: 132 on
    an H200, one a multiprocessor), at most 8 and one a block of K."""
    got = {name: w4a16_rows.wgmma_splits(n, k, 132) for name, (n, k) in LLAMA3_8B.items()}
    # qkv's 24 spans: 5 splits are 120 CTAs, 6 would be 144; o's and down's 16: 8 are 128.
    assert got == {"qkv": 5, "o": 8, "gate|up": 1, "down": 8}
    assert w4a16_rows.wgmma_splits(96, 256, 132) == 2  # at most a block of K each
    assert w4a16_rows.wgmma_splits(2048, 8192, 132) == 8  # at most 8
    assert w4a16_rows.wgmma_splits(128256, 4096, 132) == 1  # several waves


def test_cpu_tensors_stay_with_the_triton_tiles() -> None:
    w = W4A16Weight.quantize(torch.randn(64, 256), 128)
    x = torch.randn(2, 256)
    y = torch.zeros(2, 64)
    assert not w4a16_rows.native_rows(x, w.qweight, w.scales, w.zeros, 128, None, y)
    assert not y.any()


SHAPES = "m must be 1..16, n a multiple of 32, k of 128 and x_stride >= k"
# (rows, n, k, warps) a rows kernel refuses (W4A16's and FP8's: test_fp8_rows.py), and
# the message's end; None: the kernel's own message for shapes.
BAD_LAUNCHES = [
    ((17, 64, 256, 4), None),
    ((0, 64, 256, 4), None),
    ((1, 48, 256, 4), None),
    ((1, 64, 200, 4), None),
    ((1, 64, 256, 17), "warps must be 1..16"),
    ((9, 64, 256, 16), "warps must be 1..8"),
    ((1, 64, 256, 0), "warps must be 1..16"),
]


@pytest.mark.parametrize(("launch", "message"), BAD_LAUNCHES)
def test_bad_launches_are_refused_before_cuda(
    launch: tuple[int, int, int, int], message: str | None
) -> None:
    rows, n, k, warps = launch
    with pytest.raises(ValueError, match=re.escape(message or SHAPES)):
        _native.w4a16_rows(0, 64, 64, 64, 64, 0, 64, rows, n, k, k, True, warps, 0)


def test_misaligned_addresses_are_refused() -> None:
    with pytest.raises(ValueError, match="misaligned"):
        _native.w4a16_rows(0, 64, 72, 64, 64, 0, 64, 1, 64, 256, 256, True, 4, 0)  # q
    with pytest.raises(ValueError, match="misaligned"):
        _native.w4a16_rows(0, 64, 64, 64, 64, 0, 64, 1, 64, 256, 258, True, 4, 0)  # stride


def test_rows_gated_takes_no_bias_and_n_of_64s() -> None:
    for bias, n in ((64, 256), (0, 96)):
        with pytest.raises(ValueError, match="gated takes no bias and n a multiple of 64"):
            _native.w4a16_rows(0, 64, 64, 64, 64, bias, 64, 1, n, 256, 256, True, 4, 0, gated=True)


def normed(
    *, x: int = 64, residual: int = 128, gamma: int = 192, summed: int = 256, n: int = 64,
    k: int = 256, warps: int = 4, gated: bool = False,
) -> None:  # fmt: skip
    """A normed launch on these addresses (words, scales, zeros and y at 64)."""
    _native.w4a16_rows_normed(
        0, x, residual, gamma, summed, 1e-6, 64, 64, 64, 0, 64, n, k, True, warps, 0, gated
    )


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        ({"k": 16384 + 128, "warps": 16}, "m must be 1 and k at most 16384 and 1024 a warp"),
        ({"k": 4096 + 128}, "m must be 1 and k at most 16384 and 1024 a warp"),  # 4 warps
        ({"k": 200}, SHAPES),
        ({"warps": 17}, "warps must be 1..16"),
        ({"x": 72}, "misaligned"),  # x, residual, gamma and summed 16 bytes at a time
        ({"residual": 136}, "misaligned"),
        ({"gamma": 0}, "misaligned"),
        ({"gamma": 200}, "misaligned"),
        ({"summed": 264}, "misaligned"),
        ({"summed": 128}, "summed must not be x or the residual"),
        ({"summed": 64}, "summed must not be x or the residual"),
        ({"n": 96, "gated": True}, "gated takes no bias and n a multiple of 64"),
    ],
)
def test_bad_normed_launches_are_refused_before_cuda(launch: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        normed(**launch)


def test_normed_launches_without_residual_or_summed_pass_the_checks() -> None:
    if _native.probe_cuda()["available"]:
        pytest.skip("this machine has CUDA: the launch would run")
    launches: list[dict[str, Any]] = [{"residual": 0, "summed": 0}, {"summed": 0}, {}]
    for launch in launches:
        with pytest.raises(RuntimeError, match="CUDA"):  # past the checks, to the driver
            normed(**launch)


def test_cpu_tensors_stay_with_the_norm_and_tiles() -> None:
    w = W4A16Weight.quantize(torch.randn(64, 256), 128)
    x, residual, gamma = torch.randn(1, 256), torch.randn(1, 256), torch.ones(256)
    y = torch.zeros(1, 64)
    packed = (w.qweight, w.scales, w.zeros, 128)
    assert not native_normed(x, gamma, 1e-6, residual, None, packed, None, y)
    assert not y.any()
    assert w.matmul_normed(x, Norm(gamma, 1e-6, residual)) is None


# (rows past the kernel's most, None for its most; n, k, x_stride, splits) a kernel that
# splits K refuses, and the message's end; None: the kernel's own one for shapes.
BAD_SPLIT_LAUNCHES = [
    ((1, 64, 256, 256, 2), None),
    ((None, 48, 256, 256, 2), None),
    ((None, 64, 256, 128, 2), None),
    ((None, 64, 256, 256, 3), "splits must be 1..2 (k / 128"),
    ((None, 64, 256, 256, 0), "splits must be 1..2 (k / 128"),
    ((None, 64, 256, 260, 2), "misaligned"),  # a row stride not a multiple of 8
]


@pytest.mark.parametrize(("name", "max_rows"), [("w4a16_wide", 32), ("w4a16_wgmma", 64)])
@pytest.mark.parametrize(("launch", "message"), BAD_SPLIT_LAUNCHES)
def test_bad_split_launches_are_refused_before_cuda(
    name: str, max_rows: int, launch: tuple[int | None, int, int, int, int], message: str | None
) -> None:
    past, n, k, stride, splits = launch
    rows = max_rows + (past or 0)
    shapes = f"m must be 1..{max_rows}, n a multiple of 32, k of 128 and x_stride >= k"
    with pytest.raises(ValueError, match=re.escape(message or shapes)):
        kernel = getattr(_native, name)
        kernel(0, 64, 64, 64, 64, 0, 64, 64, 64, rows, n, k, stride, splits, True, 0)


def test_wgmma_splits_are_at_most_8() -> None:
    with pytest.raises(ValueError, match=re.escape("splits must be 1..8 (k / 128, at most 8)")):
        _native.w4a16_wgmma(0, 64, 64, 64, 64, 0, 64, 64, 64, 33, 64, 2048, 2048, 9, True, 0)


def test_wgmma_needs_16_byte_scales_and_zeros() -> None:
    for s, z in ((72, 64), (64, 68)):  # scales 8-byte aligned, zeros 4-byte aligned
        with pytest.raises(ValueError, match="misaligned"):
            _native.w4a16_wgmma(0, 64, 64, s, z, 0, 64, 0, 0, 33, 64, 256, 256, 1, True, 0)


def test_wgmma_needs_work_and_counters_for_splits() -> None:
    with pytest.raises(ValueError, match="misaligned"):  # two splits, no work
        _native.w4a16_wgmma(0, 64, 64, 64, 64, 0, 64, 0, 64, 33, 64, 256, 256, 2, True, 0)
    with pytest.raises(ValueError, match="misaligned"):  # work 8-byte aligned only
        _native.w4a16_wgmma(0, 64, 64, 64, 64, 0, 64, 72, 64, 33, 64, 256, 256, 2, True, 0)
    with pytest.raises(ValueError, match="misaligned"):  # two splits, no counters
        _native.w4a16_wgmma(0, 64, 64, 64, 64, 0, 64, 64, 0, 33, 64, 256, 256, 2, True, 0)
    with pytest.raises(ValueError, match="misaligned"):  # 64-bit counters 4-byte aligned
        _native.w4a16_wgmma(0, 64, 64, 64, 64, 0, 64, 64, 68, 33, 64, 256, 256, 2, True, 0)
    if not _native.probe_cuda()["available"]:  # refused for want of CUDA, not of addresses
        with pytest.raises(RuntimeError, match="CUDA"):
            _native.w4a16_wgmma(0, 64, 64, 64, 64, 0, 64, 64, 64, 33, 64, 256, 256, 2, True, 0)


def test_wide_needs_aligned_x_and_work_for_splits() -> None:
    with pytest.raises(ValueError, match="misaligned"):  # x 8-byte aligned only
        _native.w4a16_wide(0, 72, 64, 64, 64, 0, 64, 64, 64, 17, 64, 256, 256, 1, True, 0)
    with pytest.raises(ValueError, match="misaligned"):  # two splits, no work
        _native.w4a16_wide(0, 64, 64, 64, 64, 0, 64, 0, 64, 17, 64, 256, 256, 2, True, 0)


@pytest.mark.skipif(_native.probe_cuda()["available"], reason="this machine has CUDA")
def test_without_cuda_it_says_why() -> None:
    assert "CUDA" in _native.w4a16_rows_ready(0)
    with pytest.raises(RuntimeError, match="CUDA"):
        _native.w4a16_rows(0, 64, 64, 64, 64, 0, 64, 1, 64, 256, 256, True, 4, 0)
    with pytest.raises(RuntimeError, match="CUDA"):
        _native.w4a16_wide(0, 64, 64, 64, 64, 0, 64, 0, 0, 17, 64, 256, 256, 1, True, 0)
    assert "CUDA" in _native.w4a16_wgmma_ready(0)
    with pytest.raises(RuntimeError, match="CUDA"):
        _native.w4a16_wgmma(0, 64, 64, 64, 64, 0, 64, 0, 0, 33, 64, 256, 256, 1, True, 0)


@pytest.mark.parametrize(
    ("bias", "n", "splits"),
    [(64, 256, 1), (0, 96, 1), (0, 256, 2)],  # a bias; n not a multiple of 64; two splits
)
def test_wgmma_gated_takes_one_split_no_bias_and_n_of_64s(bias: int, n: int, splits: int) -> None:
    with pytest.raises(ValueError, match="gated takes the wgmma kernel, one split"):
        _native.w4a16_wgmma(
            0, 64, 64, 64, 64, bias, 64, 64, 64, 33, n, 256, 256, splits, True, 0, gated=True
        )


EXPERTS_SHAPES = (
    "rows must be 8, 16 or 64, blocks 1..65535, n a multiple of 32, k of 128, x_stride >= k, "
    "num_pairs and row_div >= 1"
)
# (rows, blocks, num_pairs, row_div, n, k, x_stride, warps) the experts kernel refuses,
# and the message's end; None: its message for shapes.
BAD_EXPERTS_LAUNCHES = [
    ((12, 4, 8, 2, 64, 256, 256, 4), None),
    ((16, 0, 8, 2, 64, 256, 256, 4), None),
    ((16, 65536, 8, 2, 64, 256, 256, 4), None),
    ((16, 4, 0, 2, 64, 256, 256, 4), None),
    ((16, 4, 8, 0, 64, 256, 256, 4), None),
    ((16, 4, 8, 2, 48, 256, 256, 4), None),
    ((16, 4, 8, 2, 64, 200, 200, 4), None),
    ((16, 4, 8, 2, 64, 256, 128, 4), None),
    ((16, 4, 8, 2, 64, 256, 256, 9), "warps must be 1..8"),
    ((8, 4, 8, 2, 64, 256, 256, 17), "warps must be 1..16"),
    ((8, 4, 8, 2, 64, 256, 258, 4), "misaligned"),  # a row stride not a multiple of 4
    ((32, 4, 8, 2, 64, 256, 256, 4), None),
    ((64, 4, 8, 2, 64, 256, 256, 4), "64 rows take sorted pairs and warps 0"),
    ((64, 4, 8, 2, 64, 256, 260, 0), "misaligned"),  # the wgmma kernel's: a multiple of 8
]


@pytest.mark.parametrize(("launch", "message"), BAD_EXPERTS_LAUNCHES)
def test_bad_experts_launches_are_refused_before_cuda(
    launch: tuple[int, ...], message: str | None
) -> None:
    rows, blocks, num_pairs, row_div, n, k, stride, warps = launch
    with pytest.raises(ValueError, match=re.escape(message or EXPERTS_SHAPES)):
        _native.w4a16_experts(
            0, 64, 64, 64, 64, 64, 64, 0, 64,
            rows, blocks, num_pairs, row_div, n, k, stride, True, warps, 0,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "pairs", "n", "weights", "message"),
    [
        (64, 0, 128, 0, "64 rows take sorted pairs"),  # no sorted pairs
        (64, 64, 96, 0, "gated takes no weights and n a multiple of 64"),
        (64, 64, 128, 64, "gated takes no weights and n a multiple of 64"),
        (16, 64, 96, 0, "gated takes no weights and n a multiple of 64"),
        (8, 0, 128, 64, "gated takes no weights and n a multiple of 64"),
    ],
)
def test_gated_experts_take_no_weights_and_n_of_64s(
    rows: int, pairs: int, n: int, weights: int, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _native.w4a16_experts(
            0, 64, 64, 64, 64, pairs, 64, weights, 64, rows, 4, 8, 2, n, 256, 256, True,
            0 if rows == 64 else 4, 0, gated=True,
        )  # fmt: skip


def test_experts_64_row_blocks_copy_16_bytes() -> None:
    """x, scales and zeros at 16-byte boundaries for the wgmma kernel (8 do for 16 rows)."""
    for at in (0, 2, 3):  # x, s, z
        addresses = [64, 64, 64, 64, 64, 64, 0, 64]
        addresses[at] = 72
        x, q, s, z, pairs, experts, weights, y = addresses
        with pytest.raises(ValueError, match="misaligned"):
            _native.w4a16_experts(
                0, x, q, s, z, pairs, experts, weights, y, 64, 4, 8, 2, 64, 256, 256, True, 0, 0
            )


def test_experts_without_sorted_pairs_take_a_block_a_pair() -> None:
    with pytest.raises(ValueError, match=re.escape("a block a pair (blocks == num_pairs)")):
        _native.w4a16_experts(0, 64, 64, 64, 64, 0, 64, 0, 64, 8, 4, 8, 8, 64, 256, 256, True, 4, 0)


def test_experts_need_aligned_addresses() -> None:
    ok = (64, 64, 64, 64, 64, 64, 0, 64)
    for at, bad in ((5, 0), (6, 66), (1, 72)):  # experts null; weights, q misaligned
        addresses = list(ok)
        addresses[at] = bad
        x, q, s, z, pairs, experts, weights, y = addresses
        with pytest.raises(ValueError, match="misaligned"):
            _native.w4a16_experts(
                0, x, q, s, z, pairs, experts, weights, y, 16, 4, 8, 2, 64, 256, 256, True, 4, 0
            )


def test_cpu_experts_stay_with_the_triton_kernel() -> None:
    experts = W4A16Experts.quantize(torch.randn(2, 64, 256), 128)
    x = torch.randn(3, 256)
    parts = (experts.qweight, experts.scales, experts.zeros, 128)
    assert w4a16_rows.experts_blocks(x, experts.qweight, experts.scales, 128) == ()
    y = torch.zeros(6, 64)
    pairs, blocks = torch.zeros(16, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    assert not w4a16_rows.native_experts(x, *parts, pairs, blocks, y, row_div=2, block_m=16)
    assert not y.any()


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        ((16, 0, 64, 1, 8, 2), "mixed takes 8 rows, no sorted pairs, weights"),
        ((8, 64, 64, 1, 8, 2), "mixed takes 8 rows, no sorted pairs, weights"),
        ((8, 0, 0, 1, 8, 2), "mixed takes 8 rows, no sorted pairs, weights"),
        ((8, 0, 64, 8, 8, 2), "mixed takes 8 rows, no sorted pairs, weights"),
        ((8, 0, 64, 1, 17, 1), "<= 16 pairs"),
        ((8, 0, 64, 1, 8, 5), "warps must be 1..16"),  # 20 warps a CTA: 4 x 5
        ((8, 0, 64, 1, 3, 9), "warps must be 1..16"),  # 2 x 9
        ((8, 0, 64, 1, 8, 0), "warps must be 1..16"),
    ],
)
def test_bad_mixed_launches_are_refused_before_cuda(launch: tuple[int, ...], message: str) -> None:
    """One token's mix: 8 rows, no sorted ids, routing weights, one block of at most 16
    pairs, and two pairs' warps times ceil(pairs / 2) at most the 8-row kernel's 16."""
    rows, pairs, weights, blocks, num_pairs, warps = launch
    with pytest.raises(ValueError, match=re.escape(message)):
        _native.w4a16_experts(
            0, 64, 64, 64, 64, pairs, 64, weights, 64, rows, blocks, num_pairs, 1, 64, 256,
            256, True, warps, 0, mixed=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("is not mixed")):  # nor gated
        _native.w4a16_experts(
            0, 64, 64, 64, 64, 0, 64, 0, 64, 8, 1, 8, 1, 64, 256, 256, True, 2, 0,
            gated=True, mixed=True,
        )  # fmt: skip
