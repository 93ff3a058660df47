"""The W4A16 GEMM (kernels/w4a16.py) compiled on a GPU at Llama-3-8B's linear shapes, in
bfloat16 and float16, against dequantize() and a float32 product.

Tolerance: relative (Frobenius) error under TOLERANCE of test_turbo_kernels, 2e-3 in
float16 and 1.6e-2 in bfloat16. The decode tiling's products are exact (q - z is an
integer in the dtype, the dot accumulates in float32) and the output is rounded once;
the prefill tiling and the dequantize + cuBLAS route also round each (q - z) * s to the
dtype once. Both stay near a tenth of the bound (bf16: ~2e-3). Timings are
scripts/w4a16_tiles.py's business, not a test's. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.turbo.kernels import w4a16 as w4a16_kernels
from lmd.engine.turbo.kernels import w4a16_rows
from lmd.engine.turbo.kernels.w4a16 import w4a16_matmul
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from tests.unit.test_turbo_kernels import TOLERANCE, rel_err

pytestmark = pytest.mark.gpu
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate|up, down
_weights: dict[tuple[int, int, torch.dtype], tuple[W4A16Weight, torch.Tensor]] = {}


def weight_and_reference(n: int, k: int, dtype: torch.dtype) -> tuple[W4A16Weight, torch.Tensor]:
    """A random [N, K] weight quantized once per shape and dtype, with its dequantized
    float32 transpose [K, N]."""
    key = (n, k, dtype)
    if key not in _weights:
        _weights.clear()  # one at a time: the largest reference is 470 MB
        dense = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
        weight = W4A16Weight.quantize(dense, 128)
        _weights[key] = (weight, weight.dequantize().t().contiguous())
    return _weights[key]


@pytest.mark.parametrize("rows", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_llama3_shapes(n: int, k: int, dtype: torch.dtype, rows: int) -> None:
    weight, reference = weight_and_reference(n, k, dtype)
    x = torch.randn(rows, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    y = w4a16_matmul(x, weight.qweight, weight.scales, weight.zeros, 128, bias)
    ref = x.float() @ reference + bias.float()
    assert y.shape == (rows, n) and y.dtype == dtype
    assert rel_err(y, ref) < TOLERANCE[dtype]


def test_decode_is_captured_in_a_cuda_graph() -> None:
    """No host sync and no allocation outside torch's pool: a graph replays it."""
    weight, reference = weight_and_reference(4096, 4096, torch.bfloat16)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    weight.matmul(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = weight.matmul(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, x.float() @ reference) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_nibbles_change_no_bit(
    dtype: torch.dtype, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PTX that turns two words' nibbles into floats at once gives the very values
    of the element-wise form: the products are bit-equal with it off (the Triton tiles:
    the native kernel would take rows 1 and 16)."""
    monkeypatch.setattr(w4a16_rows, "NATIVE_ROWS", False)
    weight, _ = weight_and_reference(4096, 14336, dtype)  # down: K split at decode
    x = torch.randn(rows, 14336, device="cuda").to(dtype)
    tensors = (weight.qweight, weight.scales, weight.zeros, 128)
    y = w4a16_matmul(x, *tensors)
    monkeypatch.setattr(w4a16_kernels, "PACKED_NIBBLES", False)
    assert torch.equal(w4a16_matmul(x, *tensors), y)
