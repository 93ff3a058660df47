"""float32 weights that are a GGUF's Q4_1 / Q8_0 blocks, held as codes for decode's
panel_gemm (torch_backend/weight_codes.py, native/panel_gemm.h)."""

from __future__ import annotations

import pytest
import torch

from lmd.engine.torch_backend import linear, native_cpu
from lmd.engine.torch_backend.linear import PANEL_ROWS, PackedWeight, can_pack
from lmd.engine.torch_backend.weight_codes import code_pairs, find_codes

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="this torch has no oneDNN linear"
)


def dequantized(n: int, k: int, bits: int, seed: int) -> torch.Tensor:
    """A random weight [n, k] as a GGUF converter dequantizes one, per block of 32 inputs:
    Q4_1 d * q + m (q 0..15), Q8_0 d * q (q -127..127, d = the block's largest |w| /
    127 as llama.cpp's quantizer makes them); d, m float16, the math float32."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-4).half().float()
    if bits == 4:
        q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15  # as a quantizer's: the block's least and most
        m = (-torch.rand(n, k // 32, 1, generator=g) * 0.2).half().float()
        w = d * q + m
    else:
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
        q[..., 0] = 127
        w = d * q
    return w.reshape(n, k)


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_are_found_exactly_and_the_layout_holds_them(bits: int) -> None:
    w = dequantized(16, 96, bits, seed=bits)
    codes = find_codes(w)
    assert codes is not None and codes.bits == bits
    assert codes.scales.shape == codes.mins.shape == (2, 3, 8)
    per_input = codes.codes.shape == ((2, 96) if bits == 4 else (2, 96, 8))
    assert per_input
    # Rebuild every weight from the layout: output 8 p + j, input i.
    if bits == 4:
        shifts = torch.arange(8) * 4
        q = (codes.codes.unsqueeze(-1) >> shifts) & 0xF  # [2, 96, 8]
    else:
        q = codes.codes.long()
    group = torch.arange(96) // 32
    d = codes.scales[:, group, :]
    m = codes.mins[:, group, :]
    rebuilt = (q.float() * d + m).transpose(1, 2).reshape(16, 96)
    assert torch.equal(rebuilt, w)


def test_weights_that_are_not_codes_stay_float32() -> None:
    torch.manual_seed(0)
    assert find_codes(torch.randn(16, 64)) is None  # not a dequantized block
    nearly = dequantized(8, 64, 4, seed=1)
    nearly[3, 5] = torch.nextafter(nearly[3, 5], torch.tensor(1.0))  # one weight off by an ulp
    assert find_codes(nearly) is None
    assert find_codes(dequantized(8, 64, 4, seed=2)[:, :40]) is None  # k not blocks of 32
    assert find_codes(dequantized(8, 64, 4, seed=2).double()) is None


@pytest.mark.skipif(not native_cpu.supported(), reason="the CPU has no AVX2 and FMA")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_codes_give_the_float32_product_bit_for_bit(
    bits: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 to PANEL_ROWS rows, outputs off the panels' 8 (43 of 48: the padding rows are
    codes too), a bias: bitwise the product over the float32 panels."""
    w = dequantized(48, 128, bits, seed=10 + bits)[:43]
    bias = torch.randn(43)
    coded = PackedWeight(w)
    assert coded.codes is not None and coded.codes.bits == bits and coded.panels is None
    monkeypatch.setattr(linear, "find_codes", lambda weight: None)
    plain = PackedWeight(w)  # the float32 panels, as for any other weight
    assert plain.codes is None and plain.panels is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, PANEL_ROWS + 1):
            x = torch.randn(rows, 128)
            for b in (bias, None):
                assert torch.equal(coded.linear(x, b), plain.linear(x, b))
            expected = torch.nn.functional.linear(x.double(), w.double(), bias.double())
            torch.testing.assert_close(
                coded.linear(x, bias), expected.float(), rtol=1e-5, atol=1e-5
            )
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not native_cpu.supported(), reason="the CPU has no AVX2 and FMA")
@pytest.mark.parametrize("bits", [4, 8, 32])
def test_two_panels_a_512_bit_vector_give_the_8_lane_product_bit_for_bit(bits: int) -> None:
    """panel_gemm with AVX-512 (two panels a vector, on where the CPU has it) against
    the 8-lane kernel, bitwise: 1 to PANEL_ROWS rows, 43 outputs (6 panels: the last
    pair cut short) and 75 (10 panels), codes and float32 panels, a bias, two threads."""
    from lmd._native import panel_gemm_wide

    if not panel_gemm_wide():
        pytest.skip("this CPU has no AVX-512F and DQ")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in (43, 75):
            w = dequantized(-(-n // 16) * 16, 128, 4 if bits == 32 else bits, seed=n)[:n]
            if bits == 32:
                w = w + torch.randn(w.shape) * 1e-3  # not codes: the float32 panels
            packed = PackedWeight(w)
            assert (packed.codes is None) == (bits == 32)
            bias = torch.randn(n)
            for rows in range(1, PANEL_ROWS + 1):
                x = torch.randn(rows, 128)
                wide = packed.linear(x, bias)
                try:
                    assert not panel_gemm_wide(0)
                    narrow = packed.linear(x, bias)
                finally:
                    panel_gemm_wide(1)
                assert torch.equal(wide, narrow), (n, rows)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bits", [4, 8])
def test_code_pairs_hold_the_same_codes_inputs_paired(bits: int) -> None:
    """pair_gemm's layout (native/pair_gemm.h) of 24 outputs (3 panels: a padded
    fourth of zeros), rebuilt weight by weight."""
    w = dequantized(24, 96, bits, seed=7)
    codes = find_codes(w)
    assert codes is not None and codes.bits == bits
    pairs = code_pairs(codes)
    assert pairs.bits == bits and pairs.codes.dtype == torch.uint8
    assert pairs.scales.shape == pairs.mins.shape == (4, 3, 8)
    assert not pairs.scales[3].any() and not pairs.mins[3].any()
    if bits == 4:
        assert pairs.codes.shape == (2, 48, 16)
        both = pairs.codes.long()  # [pair, i, 16]: input 2i low, 2i + 1 high
        q = torch.stack([both & 0xF, both >> 4], dim=2)  # [pair, i, input of the two, 16]
    else:
        assert pairs.codes.shape == (2, 48, 16, 2)
        q = pairs.codes.long().transpose(2, 3)  # [pair, i, input of the two, 16]
    q = q.reshape(2, 96, 2, 8).permute(0, 2, 1, 3).reshape(4, 96, 8)  # [panel, input, 8]
    group = torch.arange(96) // 32
    rebuilt = q.float() * pairs.scales[:, group, :] + pairs.mins[:, group, :]
    assert torch.equal(rebuilt.transpose(1, 2).reshape(32, 96)[:24], w)


@pytest.mark.skipif(not native_cpu.pair_gemm_supported(), reason="the CPU has no AVX-512 BF16")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_decode_rows_multiply_the_codes_by_bf16_inputs(bits: int, threads: int) -> None:
    """A coded weight packed for bf16 GEMMs: up to PANEL_ROWS rows through pair_gemm,
    the float32 product of the codes with x rounded to bf16 (to float32 rounding order),
    1 to 16 rows, outputs off the pairs' 16 (43), a bias."""
    w = dequantized(48, 128, bits, seed=21)[:43]
    bias = torch.randn(43)
    packed = PackedWeight(w, bf16=True)
    assert packed.pairs is not None and packed.pairs.bits == bits and packed.codes is None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, PANEL_ROWS + 1):
            x = torch.randn(rows, 128)
            rounded = x.bfloat16().double()
            expected = torch.nn.functional.linear(rounded, w.double(), bias.double())
            torch.testing.assert_close(
                packed.linear(x, bias), expected.float(), rtol=1e-5, atol=1e-5
            )
            assert not torch.equal(packed.linear(x, bias), PackedWeight(w).linear(x, bias))
    finally:
        torch.set_num_threads(before)
