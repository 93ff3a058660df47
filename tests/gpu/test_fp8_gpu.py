"""The fp8 GEMMs (kernels/fp8.py, quant/fp8.py) compiled on a GPU at Llama-3-8B's
projection shapes, against float32 math on what was multiplied: x as the per-token
quantizer stored it (as it is up to 16 rows), W dequantized. Skipped without CUDA or
below capability 8.9.

Tolerance: the fp8 rounding of x and W is in the reference too, so what is left is the
sums (another order; the Triton kernel's fp8 sums promoted to float32 every 128
products, cuBLAS's per-channel ones kept in the tensor cores' shorter sums: FAST_ACCUM)
and the one rounding of the output to bf16, up to 2^-9 relative per element: 1.7e-3 of
the norm measured on an H100 at every shape and path with float32 sums (as bf16
F.linear against float32), 2.1e-3 (K = 4096) and 3.3e-3 (K = 14336) with cuBLAS's fast
sums on an H200. Bounds: 4e-3 of the norm, 1e-2 of any row's.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("fp8 GEMMs need CUDA capability 8.9+", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.turbo.kernels import fp8 as fp8_kernels
from lmd.engine.turbo.kernels import fp8_quant
from lmd.engine.turbo.quant.fp8 import Fp8Weight, quantize_per_token_ref
from tests.unit.test_turbo_fp8 import check_codes, matmul_ref

pytestmark = pytest.mark.gpu
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate|up, down
ROWS = [1, 16, 64, 512, 8192]
TOLERANCE = 4e-3  # of the output's norm (module docstring)
ROW_TOLERANCE = 1e-2  # of each row's norm


def weights(n: int, k: int, block: bool) -> Fp8Weight:
    torch.manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    return Fp8Weight.quantize(w, torch.bfloat16, (128, 128) if block else None)


def check(y: torch.Tensor, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> None:
    ref = matmul_ref(x, w, bias)  # [M, N] float32
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert not y.isnan().any()
    err = (y.float() - ref).norm(dim=1)
    assert float(err.norm() / ref.norm()) < TOLERANCE
    assert float((err / ref.norm(dim=1)).max()) < ROW_TOLERANCE


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matmul_at_llama3_shapes(n: int, k: int, block: bool) -> None:
    w = weights(n, k, block)
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        check(w.matmul(x), x, w, None)


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
def test_bias_odd_rows_and_fp16(block: bool) -> None:
    n, k = 640, 512
    for dtype in (torch.bfloat16, torch.float16):
        w = weights(n, k, block)
        w.dtype = dtype
        for m in (3, 17, 129):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            bias = torch.randn(n, device="cuda", dtype=dtype)
            check(w.matmul(x, bias), x, w, bias)


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize("m", [17, 64, 512])
def test_triton_fp8_kernel(m: int, block: bool) -> None:
    """The Triton kernel on fp8 x, which cuBLAS stands in for on a Hopper."""
    n, k = 4096, 14336
    w = weights(n, k, block)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if block:
        xq, xs = fp8_quant.quantize_per_token_group(x)
    else:
        xq, xs = fp8_quant.quantize_per_token(x)
        xs = xs.view(-1)
    y = fp8_kernels.fp8_gemm(xq, xs, w.weight, w.scale, out_dtype=x.dtype, block_scaled=block)
    check(y, x, w, None)


@pytest.mark.parametrize(("m", "k"), [(1, 4096), (512, 14336), (8192, 4096), (33, 200)])
def test_quantizers_match_torch(m: int, k: int) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    q, s = fp8_quant.quantize_per_token(x)
    ref_q, ref_s = quantize_per_token_ref(x)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    check_codes(q, ref_q)
    q, s = fp8_quant.quantize_per_token_group(x)
    ref_q, ref_s = quantize_per_token_ref(x, 128)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    check_codes(q, ref_q)


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
def test_matmul_in_a_cuda_graph(block: bool) -> None:
    """No host sync: the quantizer and GEMM capture, and a replay sees new inputs."""
    w = weights(1024, 4096, block)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w.matmul(x)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w.matmul(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check(y, x, w, None)
