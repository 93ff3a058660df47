"""The native FP8 decode kernel (native/kernels/fp8_rows.cu through kernels/fp8_rows.py)
on a GPU: against the float64 product of x (as fp16, what the kernel multiplies) by the
dequantized weights, per-channel and block-scaled, bf16 and fp16 x, with and without a
bias; against the Triton kernel it replaces; batch-invariant; captured in a CUDA graph;
saturating bf16 x past fp16's range; and declined where it does not apply. Skipped
without CUDA or below capability 8.9.

Bound: the codes and x (in fp16) are exact operands, each block's products summed in
float32 by the tensor cores and scaled in float32, so an output is the reference rounded
once to x's dtype (2^-9 relative in bf16, 2^-12 in fp16) plus float32 summation error,
which ATOL covers.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("fp8 kernels need CUDA capability 8.9+", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.turbo.kernels import fp8 as fp8_kernels
from lmd.engine.turbo.kernels import fp8_rows
from lmd.engine.turbo.kernels.fp8_rows import native_rows
from lmd.engine.turbo.quant.fp8 import Fp8Weight

pytestmark = pytest.mark.gpu
RTOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
ATOL = 1e-4
DTYPES = [torch.bfloat16, torch.float16]


def weight(n: int, k: int, dtype: torch.dtype, block: bool) -> Fp8Weight:
    torch.manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    return Fp8Weight.quantize(w, dtype, (128, 128) if block else None)


def reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    x16 = x.float().clamp(-65504, 65504).half()  # what the kernel multiplies
    y = x16.double() @ w.dequantize().double().t()
    return y if bias is None else y + bias.double()


def check(y: torch.Tensor | None, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y is not None and y.dtype == dtype and y.shape == ref.shape
    err = (y.double() - ref).abs()
    bound = RTOL[dtype] * ref.abs() + ATOL
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (96, 384), (160, 1152)], ids=str)
def test_rows_match_the_dequantized_product(
    n: int, k: int, block: bool, dtype: torch.dtype
) -> None:
    w = weight(n, k, dtype, block)
    bias = torch.randn(n, device="cuda").to(dtype) if n < 1000 else None
    for m in (1, 2, 5, 8, 9, 13, 16):
        x = torch.randn(m, k, device="cuda").to(dtype)
        y = native_rows(x, w.weight, w.scale, bias, block_scaled=block)
        check(y, reference(x, w, bias), dtype)


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
def test_rows_agree_with_the_triton_kernel(block: bool) -> None:
    w = weight(4096, 4096, torch.bfloat16, block)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    y = native_rows(x, w.weight, w.scale, None, block_scaled=block)
    triton = fp8_kernels.fp8_gemm(x, None, w.weight, w.scale, out_dtype=x.dtype, block_scaled=block)
    assert y is not None
    # The Triton kernel rounds block-scaled weights to bf16 before its dot (the native one
    # scales the block's float32 sum), so the two differ by that rounding: ~2^-9 of a term.
    err = (y.float() - triton.float()).norm() / triton.float().norm()
    assert float(err) < (4e-3 if block else 1e-3)  # 2.4e-3 measured (block)


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
def test_a_row_is_the_same_in_any_batch(block: bool) -> None:
    """Each output is its row's own sum in a fixed order: bit-equal at every M."""
    w = weight(1024, 2048, torch.bfloat16, block)
    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    full = native_rows(x, w.weight, w.scale, None, block_scaled=block)
    assert full is not None
    for m in (1, 3, 8, 9):
        part = native_rows(x[:m], w.weight, w.scale, None, block_scaled=block)
        assert part is not None and torch.equal(part, full[:m])


def test_every_warp_count_stays_within_the_bound() -> None:
    """Warps split K; each count's result stays within the bound (not bit-equal: the
    warps' partial sums differ)."""
    w = weight(256, 4096, torch.bfloat16, False)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    ref = reference(x, w, None)
    for warps in (1, 2, 4, 8, 16):
        check(native_rows(x, w.weight, w.scale, None, block_scaled=False, warps=warps), ref,
              torch.bfloat16)  # fmt: skip


def test_captured_in_a_cuda_graph() -> None:
    w = weight(1024, 1024, torch.bfloat16, False)
    x = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)
    eager = w.matmul(x)  # loads the kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w.matmul(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, eager)
    torch.testing.assert_close(out, w.matmul(x), rtol=0, atol=0)


def test_bf16_past_the_fp16_range_saturates() -> None:
    """x's 16-bit values are taken as fp16: a bf16 value past 65504 counts as 65504."""
    w = weight(64, 256, torch.bfloat16, False)
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    x[0, 7] = 1.0e6
    y = native_rows(x, w.weight, w.scale, None, block_scaled=False)
    check(y, reference(x, w, None), torch.bfloat16)
    assert y is not None and bool(y.isfinite().all())


def test_declines_what_it_does_not_take() -> None:
    w = weight(64, 256, torch.bfloat16, False)
    x = torch.randn(17, 256, device="cuda", dtype=torch.bfloat16)
    assert native_rows(x, w.weight, w.scale, None, block_scaled=False) is None  # 17 rows
    odd = weight(48, 256, torch.bfloat16, False)  # N not a multiple of 32
    assert native_rows(x[:1], odd.weight, odd.scale, None, block_scaled=False) is None
    short = weight(64, 192, torch.bfloat16, False)  # K not a multiple of 128
    assert native_rows(x[:1, :192], short.weight, short.scale, None, block_scaled=False) is None
    buf = torch.randn(1, 257, device="cuda", dtype=torch.bfloat16)
    shifted = buf[:, 1:]  # 2 bytes off 16-byte alignment
    assert native_rows(shifted, w.weight, w.scale, None, block_scaled=False) is None
    check(w.matmul(shifted), reference(shifted, w, None), torch.bfloat16)  # Triton's
    fp8_rows.NATIVE_ROWS = False
    try:
        assert native_rows(x[:1], w.weight, w.scale, None, block_scaled=False) is None
    finally:
        fp8_rows.NATIVE_ROWS = True
