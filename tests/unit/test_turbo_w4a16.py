"""W4A16 weights (quant/w4a16.py) and their GEMM (kernels/w4a16.py).

The kernel is held to `dequantize()` + a float32 product on fresh random inputs: through
Triton's interpreter on CPU (float32, float16), compiled with CUDA. Tolerance: TOLERANCE
of test_turbo_kernels, a relative error (Frobenius) of 1e-5 in float32 (summation order
only), 2e-3 in float16 and 1.6e-2 in bfloat16: the decode tiling's products are exact
and only the output is rounded once to the dtype (2^-11, 2^-8 relative); the prefill
tiling also rounds each (q - z) * s to the dtype once before tl.dot; measured errors sit
near 3e-4 in float16, an order under the bound.

`quantize` must keep every weight within half a step of its group (and reproduce weights
that sit exactly on the grid); the checkpoint readers are fed tensors packed here from
known integers the way AutoAWQ (`WQLinear_GEMM.from_linear`, nibble order 0 2 4 6 1 3 5
7 along N) and AutoGPTQ (`QuantLinear.pack`: qweight along K, qzeros along N in plain
order, zero points less one in uint32 arithmetic) write them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import DEVICE, DTYPES, TOLERANCE, rel_err

pytest.importorskip("triton")

from lmd.engine.turbo import kernels
from lmd.engine.turbo.kernels.w4a16 import Tiles, w4a16_matmul
from lmd.engine.turbo.quant.w4a16 import W4A16Weight


def random_weight(n: int, k: int, group: int, dtype: torch.dtype) -> W4A16Weight:
    return W4A16Weight.quantize(torch.randn(n, k, device=DEVICE).to(dtype), group)


def known_ints(n: int, k: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """q [K, N] and zeros [K / G, N] in 0..15 (every value present), scales [K / G, N]
    of powers of two (exact in any dtype)."""
    q = torch.randint(0, 16, (k, n), device=DEVICE)
    q[:16, 0] = torch.arange(16)
    zeros = torch.randint(0, 16, (k // group, n), device=DEVICE)
    scales = 2.0 ** torch.randint(-8, 0, (k // group, n), device=DEVICE).float()
    return q, zeros, scales


def expected_dense(q: Tensor, zeros: Tensor, scales: Tensor, group: int) -> Tensor:
    """(q - z) * s as [N, K] float32."""
    z = zeros.repeat_interleave(group, 0).float()
    s = scales.repeat_interleave(group, 0).float()
    return ((q.float() - z) * s).t()


# The kernel ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64])
@pytest.mark.parametrize(("n", "k", "group"), [(48, 256, 128), (256, 384, 64)])
def test_kernel_matches_dequantized_product(
    n: int, k: int, group: int, rows: int, dtype: torch.dtype
) -> None:
    weight = random_weight(n, k, group, dtype)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if rows % 2 else None
    y = w4a16_matmul(x, weight.qweight, weight.scales, weight.zeros, group, bias)
    ref = x.float() @ weight.dequantize().t() + (bias.float() if bias is not None else 0)
    assert y.dtype == dtype and y.shape == (rows, n)
    assert rel_err(y, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    "tiles",
    [
        Tiles(16, 32, 128, 3, 4, 2),  # K split three ways, partial sums added after
        Tiles(16, 64, 128, 0, 4, 2, swap_ab=True),
        Tiles(64, 32, 256, 1, 4, 2),  # two blocks of the layout per step
        Tiles(32, 64, 128, 2, 4, 2, swap_ab=True),
        None,  # dequantize + cuBLAS (dense_rows=1)
    ],
    ids=["split-k", "swap-ab", "block-k-256", "split-swap", "dense"],
)
def test_kernel_tilings(tiles: Tiles | None) -> None:
    dtype = DTYPES[-1]
    weight = random_weight(72, 512, 64, dtype)
    x = torch.randn(9, 512, device=DEVICE).to(dtype)
    bias = torch.randn(72, device=DEVICE).to(dtype)
    y = w4a16_matmul(
        x, weight.qweight, weight.scales, weight.zeros, 64, bias, tiles=tiles, dense_rows=1
    )
    ref = x.float() @ weight.dequantize().t() + bias.float()
    assert rel_err(y, ref) < TOLERANCE[dtype]


def test_kernel_refuses_shapes_it_cannot_take() -> None:
    weight = random_weight(16, 256, 128, torch.float32)
    with pytest.raises(ValueError, match=r"x \(2, 128\) against qweight \(32, 16\)"):
        w4a16_matmul(torch.zeros(2, 128, device=DEVICE), *weight_tensors(weight), 128)
    with pytest.raises(ValueError, match="BLOCK_K 64"):
        x = torch.zeros(2, 256, device=DEVICE)
        w4a16_matmul(x, *weight_tensors(weight), 128, tiles=Tiles(16, 16, 64, 1, 4, 1))


def weight_tensors(weight: W4A16Weight) -> tuple[Tensor, Tensor, Tensor]:
    return weight.qweight, weight.scales, weight.zeros


# The weight ------------------------------------------------------------------------


def test_matmul_takes_leading_dims_and_falls_back_without_triton(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dtype = DTYPES[-1]
    weight = random_weight(40, 256, 128, dtype)
    assert weight.shape == (40, 256) and weight.dtype == dtype
    assert weight.device.type == DEVICE.type
    assert weight.nbytes == 32 * 40 * 4 + 2 * 40 * (dtype.itemsize + 1)
    x = torch.randn(2, 3, 256, device=DEVICE).to(dtype)
    bias = torch.randn(40, device=DEVICE).to(dtype)
    ref = F.linear(x.float(), weight.dequantize(), bias.float())
    y = weight.matmul(x, bias)
    assert y.shape == (2, 3, 40) and rel_err(y, ref) < TOLERANCE[dtype]
    if not x.is_cuda:  # CPU without the interpreter: dequantize + F.linear
        monkeypatch.setattr(kernels, "interpreting", lambda: False)
        assert rel_err(weight.matmul(x, bias), ref) < TOLERANCE[dtype]
    with pytest.raises(ValueError, match="got x"):
        weight.matmul(x.float() if dtype != torch.float32 else x.half(), bias)


def test_matmul_with_an_activation_gives_act_gate_times_up() -> None:
    """W = gate | up: matmul(x, activation=...) is silu_and_mul of the product, [..., N / 2]
    (on a GPU at 33-64 rows the wgmma kernel's own launch: tests/gpu/test_w4a16_rows_gpu.py)."""
    dtype = DTYPES[-1]
    weight = random_weight(64, 256, 128, dtype)
    x = (torch.randn(2, 3, 256, device=DEVICE) / 16).to(dtype)  # gate within exp's range
    for activation in ("silu", "gelu_tanh"):
        y = weight.matmul(x, activation=activation)
        assert y.shape == (2, 3, 32)
        ref = kernels.silu_and_mul(weight.matmul(x).view(6, 64), activation)
        assert torch.equal(y.view(6, 32), ref)


def weight_steps(weight: W4A16Weight) -> Tensor:
    """Each weight's quantization step (its group's scale) as [N, packed K] float32."""
    return weight.scales.float().repeat_interleave(weight.group_size, dim=0).t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_is_within_half_a_step(dtype: torch.dtype) -> None:
    w = torch.randn(24, 512, device=DEVICE) * torch.rand(24, 1, device=DEVICE) * 3
    w[0, :128] = w[0, :128].abs() + 1  # a group of positive weights only
    w[1, 128:256] = 0.0  # an all-zero group
    w[2, 256:320] = -0.25  # a constant group
    w = w.to(dtype)
    weight = W4A16Weight.quantize(w, 64)
    assert weight.scales.dtype == dtype and weight.scales.device == w.device
    assert int(weight.zeros.max()) <= 15
    step = weight.scales.float().repeat_interleave(64, 0).t()  # [N, K]
    error = (w.float() - weight.dequantize()).abs()
    assert bool((error <= step / 2 * (1 + 1e-6) + 1e-12).all())
    assert bool((weight.dequantize()[1, 128:256] == 0).all())


def test_quantize_keeps_weights_on_the_grid_exactly() -> None:
    """Weights (q - z) * s with 0 and 15 in every group come back bit for bit, each
    group with its own zero point, across group boundaries."""
    n, k, group = 16, 256, 32
    q, zeros, scales = known_ints(n, k, group)
    q.view(k // group, group, n)[:, 0, :] = 0  # each group spans the whole range
    q.view(k // group, group, n)[:, 1, :] = 15
    dense = expected_dense(q, zeros, scales, group)
    weight = W4A16Weight.quantize(dense.to(torch.bfloat16), group)
    assert torch.equal(weight.dequantize(), dense)
    assert torch.equal(weight.zeros.long(), zeros)


@pytest.mark.parametrize("group", [128, 64])
def test_a_k_off_the_layout_is_padded_with_zero_columns(group: int) -> None:
    """SmolLM2's 576 inputs: packed as 640, the zero columns meet zero inputs."""
    torch.manual_seed(0)
    dense = torch.randn(48, 576, device=DEVICE)
    weight = W4A16Weight.quantize(dense, group)
    assert weight.shape == (48, 576) and weight.packed_shape == (48, 640)
    assert weight.in_features == 576
    got = weight.dequantize()
    assert got.shape == (48, 576)
    assert bool((got - dense).abs().le(weight_steps(weight)[:, :576] / 2 + 1e-6).all())
    x = torch.randn(3, 576, device=DEVICE)
    ref = x @ got.t()
    assert float((weight.matmul(x) - ref).norm() / ref.norm()) < 1e-5
    both = W4A16Weight.cat([weight, weight])
    assert both.shape == (96, 576) and torch.equal(both.dequantize()[48:], got)


def test_quantize_refuses_what_the_layout_cannot_hold() -> None:
    with pytest.raises(ValueError, match="group size 48"):
        W4A16Weight.quantize(torch.zeros(8, 192), 48)
    with pytest.raises(ValueError, match="zeros"):
        W4A16Weight(torch.zeros(16, 8, dtype=torch.int32), torch.zeros(1, 8), torch.zeros(2, 8))


def test_cat_stacks_output_channels() -> None:
    dtype = DTYPES[-1]
    parts = [random_weight(n, 256, 64, dtype) for n in (32, 8, 8)]
    fused = W4A16Weight.cat(parts)
    assert fused.shape == (48, 256)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, 256, device=DEVICE).to(dtype)
    assert rel_err(fused.matmul(x), x.float() @ fused.dequantize().t()) < TOLERANCE[dtype]
    with pytest.raises(ValueError, match="differ"):
        W4A16Weight.cat([parts[0], random_weight(8, 128, 64, dtype)])
    with pytest.raises(ValueError, match="at least one"):
        W4A16Weight.cat([])
