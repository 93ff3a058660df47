"""The native W4A16 decode kernels (native/kernels/w4a16_rows.cu for 1-16 rows,
w4a16_wide.cu for 17-32, w4a16_wgmma.cu for 33-64 on Hopper, through
kernels/w4a16_rows.py) on a GPU: against the float64 product of the dequantized weights,
against the Triton tiles they replace, batch-invariant (rows) or the same at every split
of K (wide, wgmma), captured in a CUDA graph, and declined where they do not apply.
Skipped without CUDA.

Bound: the rows and wide kernels' products are exact ((q - z) is an integer in the
dtype) and summed in float32, so each output is the reference rounded once to the dtype:
within half an ulp of it (2^-9 relative in bf16, 2^-12 in fp16) plus float32 summation
error, which ATOL covers. The wgmma kernel multiplies W rounded to the dtype ((q - z) *
scale, one rounding, as the Triton tiles do), so its reference is the product of that
rounded W, held to the same bound.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from lmd import _native
from lmd.engine.turbo.kernels import silu_and_mul, w4a16_rows
from lmd.engine.turbo.kernels.w4a16 import w4a16_matmul
from lmd.engine.turbo.kernels.w4a16_rows import native_rows
from lmd.engine.turbo.quant.w4a16 import W4A16Weight

pytestmark = pytest.mark.gpu
RTOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
ATOL = 1e-4  # float32 sums of ~14k products of magnitude ~1e-2


def weight(n: int, k: int, dtype: torch.dtype, group: int = 128) -> W4A16Weight:
    torch.manual_seed(n + k)
    return W4A16Weight.quantize((torch.randn(n, k, device="cuda") / k**0.5).to(dtype), group)


def reference(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.dequantize().double().t()
    return y if bias is None else y + bias.double()


def rounded_reference(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T with W = (q - z) * scale rounded to x's dtype (exact in float32 first)."""
    y = x.double() @ w.dequantize().to(x.dtype).double().t()
    return y if bias is None else y + bias.double()


hopper = pytest.mark.skipif(
    torch.cuda.get_device_capability() != (9, 0), reason="the wgmma kernel needs sm_90"
)


def native(
    x: torch.Tensor,
    w: W4A16Weight,
    bias: torch.Tensor | None = None,
    *,
    warps: int | None = None,
    splits: int | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """The product through native_rows (asserted taken); gated: silu(gate) * up."""
    y = torch.empty(x.shape[0], w.shape[0] // (2 if gated else 1), dtype=x.dtype, device="cuda")
    weight = (w.qweight, w.scales, w.zeros, w.group_size)
    assert native_rows(x, *weight, bias, y, warps=warps, splits=splits, gated=gated)
    return y


def test_kernels_load() -> None:
    assert w4a16_rows.ready(torch.device("cuda")), torch.cuda.get_device_name()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 24, 31, 32])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (96, 256)])
def test_against_float64(n: int, k: int, rows: int, dtype: torch.dtype) -> None:
    """Both kernels. (96, 256): the wide kernel's one span of 128 columns, whose last
    warp is past N, and two blocks of K."""
    w = weight(n, k, dtype)
    x = torch.randn(rows, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    for b in (None, bias):
        y = native(x, w, b)
        torch.testing.assert_close(y.double(), reference(x, w, b), rtol=RTOL[dtype], atol=ATOL)


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_every_warp_count(rows: int) -> None:
    """Each warp count splits K its own way; each gives the product."""
    w = weight(4096, 4096, torch.bfloat16)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    ref = reference(x, w, None)
    for warps in (1, 2, 4, 8, 16 if rows <= 8 else 8):
        y = native(x, w, warps=warps)
        torch.testing.assert_close(y.double(), ref, rtol=RTOL[torch.bfloat16], atol=ATOL)


def test_rows_do_not_depend_on_the_batch() -> None:
    """A row's output is the same bits alone or among 16 (same warps): the batch a
    sequence decodes in does not change its tokens."""
    w = weight(6144, 4096, torch.bfloat16)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    together = native(x, w, warps=8)
    for i in (0, 5, 15):
        assert torch.equal(native(x[i : i + 1], w, warps=8)[0], together[i])
    assert torch.equal(native(x[:8], w, warps=8), together[:8])


@pytest.mark.parametrize("rows", [4, 32])
def test_agrees_with_the_triton_tiles(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    w = weight(28672, 4096, torch.bfloat16)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    y = w4a16_matmul(x, w.qweight, w.scales, w.zeros, 128)
    assert torch.equal(y, native(x, w))  # w4a16_matmul took the native kernel
    monkeypatch.setattr(w4a16_rows, "NATIVE_ROWS", False)
    tiles = w4a16_matmul(x, w.qweight, w.scales, w.zeros, 128)
    torch.testing.assert_close(y.float(), tiles.float(), rtol=2.0**-7, atol=1e-3)


def test_strided_rows() -> None:
    """x may be rows of a wider buffer (the row stride is the kernel's argument)."""
    w = weight(4096, 4096, torch.bfloat16)
    wide = torch.randn(3, 4096 + 512, device="cuda", dtype=torch.bfloat16)
    x = wide[:, :4096]
    torch.testing.assert_close(
        native(x, w).double(), reference(x, w, None), rtol=RTOL[torch.bfloat16], atol=ATOL
    )


def test_captured_in_a_cuda_graph() -> None:
    w = weight(4096, 14336, torch.bfloat16)
    x = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
    native(x, w)  # loads the module outside the capture
    y = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert native_rows(x, w.qweight, w.scales, w.zeros, 128, None, y)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.double(), reference(x, w, None), rtol=2.0**-8, atol=ATOL)


def test_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of 64, 65 rows (33 with the wgmma kernel off or off Hopper), 48 columns,
    float32: the Triton tiles' products."""
    y = torch.empty(65, 4096, device="cuda", dtype=torch.bfloat16)
    w64 = weight(4096, 4096, torch.bfloat16, group=64)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    assert not native_rows(x, w64.qweight, w64.scales, w64.zeros, 64, None, y[:1])
    w = weight(4096, 4096, torch.bfloat16)
    x65 = torch.randn(65, 4096, device="cuda", dtype=torch.bfloat16)
    assert not native_rows(x65, w.qweight, w.scales, w.zeros, 128, None, y)
    monkeypatch.setattr(w4a16_rows, "WGMMA", False)
    assert not native_rows(x65[:33], w.qweight, w.scales, w.zeros, 128, None, y[:33])
    monkeypatch.undo()
    on_hopper = torch.cuda.get_device_capability() == (9, 0)
    assert native_rows(x65[:33], w.qweight, w.scales, w.zeros, 128, None, y[:33]) == on_hopper
    w48 = weight(48, 4096, torch.bfloat16)
    assert not native_rows(x, w48.qweight, w48.scales, w48.zeros, 128, None, y[:1, :48])
    assert not native_rows(x.float(), w.qweight, w.scales, w.zeros, 128, None, y[:1].float())
    # and w4a16_matmul still multiplies them
    out = w4a16_matmul(x, w64.qweight, w64.scales, w64.zeros, 64)
    torch.testing.assert_close(out.double(), reference(x, w64, None), rtol=2.0**-7, atol=1e-3)


@hopper
def test_wgmma_runs_one_cta_a_multiprocessor_and_refuses_more_splits_than_fit() -> None:
    """Its shared memory leaves room for one CTA a multiprocessor; a launch whose split
    CTAs would not all be resident at once (they wait for each other) is refused."""
    assert _native.w4a16_wgmma_ready(0) == ""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert w4a16_rows.wgmma_ctas(0) == sms
    w = weight(28672, 256, torch.bfloat16)  # 112 spans: two splits are 224 CTAs
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="more CTAs than the device runs at once"):
        native(x, w, splits=2)


@pytest.mark.parametrize("rows", [32, 64])
def test_every_split_of_k(rows: int) -> None:
    """The wide kernel (32 rows) and the wgmma one (64, Hopper): each split count (uneven
    ones too; the wgmma kernel's at most 8) gives the product, the same bits every launch;
    the wide kernel's span counters are zero again after it, the wgmma one's multiples of
    840 (what a launch adds to each)."""
    if rows > w4a16_rows.WIDE_MAX_ROWS and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    w = weight(4096, 4096, torch.bfloat16)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    ref = (reference if rows <= w4a16_rows.WIDE_MAX_ROWS else rounded_reference)(x, w, bias)
    for splits in (1, 2, 3, 5, 8, 32) if rows <= w4a16_rows.WIDE_MAX_ROWS else (1, 2, 3, 5, 7, 8):
        y = native(x, w, bias, splits=splits)
        torch.testing.assert_close(y.double(), ref, rtol=RTOL[torch.bfloat16], atol=ATOL)
        for _ in range(3):
            assert torch.equal(native(x, w, bias, splits=splits), y)
    device = torch.cuda.current_device()
    assert not w4a16_rows._counters[device].any()
    assert not (w4a16_rows._wgmma_counters[device] % 840).any()


@pytest.mark.parametrize(("rows", "fewer"), [(32, (24, 17)), (64, (48, 33))])
def test_split_rows_do_not_depend_on_the_rows_past_them(rows: int, fewer: tuple[int, int]) -> None:
    """The wide kernel's rows 0..16 alone (17 rows) and among 32, the wgmma one's (Hopper)
    0..32 and among 64: same splits, same bits."""
    if rows > w4a16_rows.WIDE_MAX_ROWS and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    w = weight(6144, 4096, torch.bfloat16)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    together = native(x, w, splits=4)
    for m in fewer:
        assert torch.equal(native(x[:m], w, splits=4), together[:m])


def test_wide_strided_rows_and_the_tiles_fallback() -> None:
    """x may be rows of a wider buffer; rows that are not 16-byte aligned go to the Triton
    tiles, which give the product too."""
    w = weight(4096, 4096, torch.bfloat16)
    buffer = torch.randn(20, 4096 + 512, device="cuda", dtype=torch.bfloat16)
    x = buffer[:, :4096]
    torch.testing.assert_close(
        native(x, w).double(), reference(x, w, None), rtol=RTOL[torch.bfloat16], atol=ATOL
    )
    skewed = buffer[:, 4:4100]  # 8-byte aligned rows
    y = torch.empty(20, 4096, device="cuda", dtype=torch.bfloat16)
    assert not native_rows(skewed, w.qweight, w.scales, w.zeros, 128, None, y)
    out = w4a16_matmul(skewed, w.qweight, w.scales, w.zeros, 128)  # their W rounded to bf16
    torch.testing.assert_close(out.double(), reference(skewed, w, None), rtol=2.0**-7, atol=2e-2)


@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("rows", [24, 48])
def test_split_kernels_captured_in_a_cuda_graph(rows: int, splits: int) -> None:
    """The wide kernel (24 rows) and the wgmma one (48, Hopper), x strided rows of a wider
    buffer: replayed twice with new rows, split sums, counters and all live in the graph."""
    wgmma = rows > w4a16_rows.WIDE_MAX_ROWS
    if wgmma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    w = weight(4096, 14336, torch.bfloat16)
    x = torch.randn(rows, 14336 + 512, device="cuda", dtype=torch.bfloat16)[:, :14336]
    native(x, w, splits=splits)  # loads the module outside the capture
    y = torch.empty(rows, 4096, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert native_rows(x, w.qweight, w.scales, w.zeros, 128, None, y, splits=splits)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        ref = (rounded_reference if wgmma else reference)(x, w, None)
        torch.testing.assert_close(y.double(), ref, rtol=2.0**-8, atol=ATOL)


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [33, 40, 63, 64])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (28672, 4096), (96, 256)])
def test_wgmma_against_float64(n: int, k: int, rows: int, dtype: torch.dtype) -> None:
    """(96, 256): one span of 256 columns, most of it past N, and two blocks of K;
    28672: one split (its 112 spans fill the machine)."""
    w = weight(n, k, dtype)
    x = torch.randn(rows, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    for b in (None, bias):
        y = native(x, w, b)
        ref = rounded_reference(x, w, b)
        torch.testing.assert_close(y.double(), ref, rtol=RTOL[dtype], atol=ATOL)


@hopper
def test_wgmma_agrees_with_the_triton_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both multiply W rounded to bf16; they differ by their float32 summation orders."""
    w = weight(28672, 4096, torch.bfloat16)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    y = w4a16_matmul(x, w.qweight, w.scales, w.zeros, 128)
    assert torch.equal(y, native(x, w))  # w4a16_matmul took the wgmma kernel
    monkeypatch.setattr(w4a16_rows, "WGMMA", False)
    tiles = w4a16_matmul(x, w.qweight, w.scales, w.zeros, 128)
    torch.testing.assert_close(y.float(), tiles.float(), rtol=2.0**-7, atol=1e-3)


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [33, 48, 64])
@pytest.mark.parametrize(("n", "k"), [(28672, 4096), (192, 256)])
def test_wgmma_gated_is_silu_and_mul_of_the_product(
    n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    """W = gate | up: the gated launch equals silu_and_mul of the same kernel's product
    within a rounding of the dtype (its sigmoid is the kernel's own). (192, 256): one span
    whose 128 outputs run past I = 96."""
    w = weight(n, k, dtype)
    x = torch.randn(rows, k, device="cuda").to(dtype)
    y = native(x, w, splits=1, gated=True)
    ref = silu_and_mul(native(x, w, splits=1))
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, ref, rtol=2 * eps, atol=2 * eps * float(ref.abs().max()))
    assert torch.equal(native(x, w, splits=1, gated=True), y)


def test_gated_is_refused_where_no_kernel_takes_it() -> None:
    """Rows the wide kernel takes (17-32), a bias, and several splits: native_rows says
    no (y untouched) and W4A16Weight.matmul takes the two launches instead. (1-16 rows:
    test_w4a16_normed_gpu.py.)"""
    w = weight(512, 256, torch.bfloat16)
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    for rows, b, splits in ((24, None, 1), (64, bias, 1), (64, None, 2), (8, bias, 1)):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        y = torch.zeros(rows, 256, device="cuda", dtype=torch.bfloat16)
        weights = (w.qweight, w.scales, w.zeros, w.group_size)
        assert not native_rows(x, *weights, b, y, splits=splits, gated=True)
        assert not y.any()
        out = w.matmul(x, b, "silu")
        torch.testing.assert_close(out, silu_and_mul(w.matmul(x, b)), rtol=0, atol=0)
