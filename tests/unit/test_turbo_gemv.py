"""The skinny products (kernels/gemv.py: up to 16 rows through tl.dot; kernels/
vector_gemv.py: one row, its input made in the same launch) against float32 references.

As tests/unit/test_turbo_kernels.py: Triton's interpreter on CPU tensors without CUDA,
compiled on a GPU; skipped where triton is not installed.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

# First: without CUDA this switches Triton to its interpreter before turbo is imported
# (and skips this module where triton is not installed, as the next line says).
from tests.unit.test_turbo_kernels import (
    DEVICE,
    DTYPES,
    TOLERANCE,
    rel_err,
    rms_norm_ref,
    rope_table,
)

pytest.importorskip("triton")

from lmd.engine.turbo import kernels
from lmd.engine.turbo.kernels import kv_quant

# the module (the package's `vector_gemv` is its function)
vector_gemv_module = importlib.import_module("lmd.engine.turbo.kernels.vector_gemv")


def check_gemv(
    rows: int, n: int, k: int, dtype: torch.dtype, *, bias: bool, out_float: bool
) -> None:
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    out_dtype = torch.float32 if out_float else None
    y = kernels.gemv(x, w, b, out_dtype=out_dtype)
    assert y.dtype == (torch.float32 if out_float else dtype) and y.shape == (rows, n)
    assert rel_err(y, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "k", "extras"),
    [(1, 40, 64, ""), (3, 70, 200, "bias"), (16, 33, 2100, "float32 out")],
)
def test_gemv(rows: int, n: int, k: int, extras: str, dtype: torch.dtype) -> None:
    check_gemv(rows, n, k, dtype, bias="bias" in extras, out_float="float32" in extras)


def test_gemv_refuses_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match=f"up to {kernels.GEMV_MAX_ROWS}"):
        kernels.gemv(torch.zeros(17, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))


def check_vector_gemv(n: int, k: int, dtype: torch.dtype, prologue: str, out_float: bool) -> None:
    """One row times W^T, its input made in the same launch (RMSNorm of the residual
    stream), against float32 references; the summed stream equal to what
    kernels.rms_norm leaves, the normed row to what it returns within a rounding (its
    squares summed in another order)."""
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if prologue == "bias" else None
    out_dtype = torch.float32 if out_float else None
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    if prologue.startswith("norm"):
        weight = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
        residual = torch.randn(1, k, device=DEVICE).to(dtype) if "residual" in prologue else None
        summing = residual is not None and "unsummed" not in prologue  # lm_head's: no sum
        summed = torch.empty(1, k, device=DEVICE, dtype=dtype) if summing else None
        normed = torch.empty(1, k, device=DEVICE, dtype=dtype)
        norm = kernels.Norm(weight, 1e-6, residual, summed, normed)
        y = kernels.vector_gemv(x, w, norm=norm, out_dtype=out_dtype)
        made = kernels.rms_norm(x, weight, 1e-6, None if residual is None else residual.clone())
        ulp = torch.finfo(dtype).eps * made.float().abs() + 1e-6
        assert bool(((normed.float() - made.float()).abs() <= ulp).all())
        stream = x.float() + (residual.float() if residual is not None else 0)
        ref = rms_norm_ref(stream, weight, 1e-6) @ w.float().t()
        if residual is not None and summed is not None:
            expected = residual.clone()
            kernels.rms_norm(x, weight, 1e-6, expected)  # leaves the sum in `expected`
            assert torch.equal(summed, expected)
    else:
        y = kernels.vector_gemv(x, w, b, out_dtype=out_dtype)
        ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    assert y.shape == (1, n) and y.dtype == (torch.float32 if out_float else dtype)
    assert rel_err(y, ref) < 2 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "k", "prologue", "out_float"),
    [
        (40, 64, "", False),
        (33, 300, "bias", True),
        (70, 200, "norm", False),
        (17, 600, "norm residual", True),
        (17, 600, "norm residual unsummed", True),
    ],
)
def test_vector_gemv(n: int, k: int, prologue: str, out_float: bool, dtype: torch.dtype) -> None:
    check_vector_gemv(n, k, dtype, prologue, out_float)


@pytest.mark.parametrize(("n", "k", "h200"), [(33, 300, False), (8, 4096, False), (6, 4100, False),
                                              (40, 2048, True)])  # fmt: skip
def test_vector_gemv_with_the_plain_products_tiles(n: int, k: int, h200: bool) -> None:
    """o and down at one row (TurboModel.vector_plain): plain_tiles' two rows a program,
    K past 4096 on default_tiles'; and the H200's 16 x 1024 on 8 warps in two stages."""
    tiles = (16, 1024, 8, 2) if h200 else kernels.plain_tiles(n, k)
    assert h200 or tiles[0] == (2 if k <= 4096 else 4)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    y = kernels.vector_gemv(x, w, b, tiles=tiles)
    assert rel_err(y, x.float() @ w.float().t() + b.float()) < 2 * TOLERANCE[torch.bfloat16]


def test_vector_gemv_tiles_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H100's sweep's tiles anywhere but on an H200, whose own differ for qkv-sized
    products and vocabularies."""
    h100 = [vector_gemv_module.default_tiles(n, 4096, torch.device("cpu")) for n in (6144, 128256)]
    assert h100 == [(4, 1024, 4, 3), (16, 512, 4, 3)]
    monkeypatch.setattr(vector_gemv_module, "_device_name", lambda _: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    assert vector_gemv_module.default_tiles(6144, 4096, cuda) == (8, 512, 4, 3)
    assert vector_gemv_module.default_tiles(128256, 4096, cuda) == (4, 1024, 4, 3)
    assert vector_gemv_module.default_tiles(4096, 4096, cuda) == (4, 1024, 4, 3)  # o: H100's
    assert vector_gemv_module.default_tiles(24576, 4096, cuda) == (8, 1024, 4, 2)  # gate|up
    assert vector_gemv_module.default_tiles(6144, 4096) == (4, 1024, 4, 3)  # no device: H100's
    assert vector_gemv_module.plain_tiles(4096, 12288, cuda) == (16, 1024, 8, 2)  # down
    assert vector_gemv_module.plain_tiles(2048, 4096, cuda) == (2, 1024, 4, 4)  # < 256 programs
    assert vector_gemv_module.plain_tiles(4096, 2048, cuda) == (2, 1024, 4, 4)  # K unswept
    assert vector_gemv_module.default_tiles(17920, 1536, cuda) == (4, 1024, 4, 3)  # K unswept
    assert vector_gemv_module.plain_tiles(4096, 4096) == (2, 1024, 4, 4)  # no device


def test_vector_gemv_refuses_what_it_cannot_take() -> None:
    w = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="one contiguous row"):
        kernels.vector_gemv(torch.zeros(2, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="one contiguous row of 8"):
        kernels.vector_gemv(torch.zeros(1, 16, device=DEVICE), w)
    x = torch.zeros(1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="separate `summed`"):
        kernels.vector_gemv(x, w, norm=kernels.Norm(torch.ones(8, device=DEVICE), 1e-6, x, x))
    with pytest.raises(ValueError, match="weight of K"):
        kernels.vector_gemv(x, w, norm=kernels.Norm(torch.ones(4, device=DEVICE), 1e-6))
    with pytest.raises(ValueError, match="normed is a tensor of its own"):
        kernels.vector_gemv(x, w, norm=kernels.Norm(torch.ones(8, device=DEVICE), 1e-6, normed=x))
    with pytest.raises(ValueError, match=r"gate \| up rows, got 5"):
        kernels.vector_gemv(x, torch.zeros(5, 8, device=DEVICE), activation="silu")
    with pytest.raises(ValueError, match="not silu or gelu_tanh"):
        kernels.vector_gemv(x, w, activation="relu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(
    ("width", "k", "tiles"),
    [(35, 200, None), (24, 600, (8, 256, 4, 3)), (20, 2048, (8, 1024, 4, 2))],  # last: H200's
)
def test_vector_gemv_folds_the_gated_activation(
    width: int, k: int, tiles: tuple[int, int, int, int] | None, activation: str, dtype: torch.dtype
) -> None:
    """gate | up's product with act(gate) * up in its launch: the values of the product
    and silu_and_mul, bit for bit, and near the float32 reference."""
    w = (torch.randn(2 * width, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(2 * width, device=DEVICE).to(dtype)
    x, residual = (torch.randn(1, k, device=DEVICE).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    norm = kernels.Norm(weight, 1e-6, residual, torch.empty_like(residual))
    y = kernels.vector_gemv(x, w, b, norm=norm, tiles=tiles, activation=activation)
    product = kernels.vector_gemv(x, w, b, norm=norm, tiles=tiles)
    assert y.shape == (1, width) and y.dtype == dtype
    assert torch.equal(y, kernels.silu_and_mul(product, activation))
    h = rms_norm_ref(x.float() + residual.float(), weight, 1e-6) @ w.float().t() + b.float()
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    assert rel_err(y, act * up) < 2 * TOLERANCE[dtype]


def _rotary(
    kind: str, qk_norm: bool, slot: int, dtype: torch.dtype
) -> tuple[kernels.Rotary, Tensor]:
    """A Rotary of one token at position 37 into layer 1 of a random 3-layer pool of
    `kind` ("16-bit": `dtype`, or "int8" codes) with 4 q heads and 2 KV heads of 16;
    and the pool's raw bytes (for a quantized pool: codes and scales both)."""
    blocks, layers, block_size, kv_heads, head_dim = 6, 3, 4, 2, 16
    if kind == "int8":
        raw, kv, scales = kv_quant.quantized_pool(
            blocks, layers, block_size, kv_heads, head_dim, "int8", DEVICE
        )
        raw.copy_(torch.randint(0, 100, raw.shape, dtype=torch.uint8))
    else:
        kv = torch.randn(blocks, layers, 2, block_size, kv_heads, head_dim, device=DEVICE)
        kv = raw = kv.to(dtype)
        scales = None
    seeded = torch.Generator().manual_seed(3)  # the same head norms each call
    norms = [torch.rand(head_dim, generator=seeded).add(0.5).to(DEVICE, dtype) for _ in "qk"]
    rotary = kernels.Rotary(
        torch.tensor([37], device=DEVICE),
        torch.tensor([slot], device=DEVICE),
        rope_table(64, head_dim).to(DEVICE),
        kv,
        1,
        4,
        norms[0] if qk_norm else None,
        norms[1] if qk_norm else None,
        1e-6,
        scales,
        torch.zeros(8, dtype=torch.int32, device=DEVICE),
    )
    return rotary, raw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("kind", "qk_norm", "slot", "block_n"),
    [
        ("16-bit", True, 9, 4),
        ("16-bit", False, 22, 16),
        ("int8", True, 5, 8),
        ("16-bit", True, -1, 2),
    ],
)
def test_vector_gemv_does_a_qkv_products_rotary(
    kind: str, qk_norm: bool, slot: int, block_n: int, dtype: torch.dtype
) -> None:
    """One token's qkv product with its rotary and K/V write in its launch (the last
    program of each head does it, counting on rotary.counts): the product, the pool (a
    negative slot: untouched) and the counters as the product followed by
    rotary_and_cache_write's launch leave them, bit for bit."""
    k = 48
    w = (torch.randn(8 * 16, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(8 * 16, device=DEVICE).to(dtype)
    x, residual = (torch.randn(1, k, device=DEVICE).to(dtype) for _ in range(2))
    norm = kernels.Norm(torch.ones(k, device=DEVICE).to(dtype), 1e-6, residual, None)
    tiles = (block_n, 32, 4, 3)
    fused, raw = _rotary(kind, qk_norm, slot, dtype)
    before = raw.clone()
    y = kernels.vector_gemv(x, w, b, norm=norm, tiles=tiles, rotary=fused)
    apart, raw_apart = _rotary(kind, qk_norm, slot, dtype)
    raw_apart.copy_(before)
    expected = kernels.vector_gemv(x, w, b, norm=norm, tiles=tiles)
    apart.apply(expected)
    assert torch.equal(y, expected) and fused.counts is not None and not fused.counts.any()
    assert torch.equal(raw, raw_apart)
    assert torch.equal(raw, before) == (slot < 0)
    for misfit in ((32, 32, 4, 3), (3, 32, 4, 3)):  # across heads
        with pytest.raises(ValueError, match="columns a program"):
            kernels.vector_gemv(x, w, b, norm=norm, tiles=misfit, rotary=fused)
    with pytest.raises(ValueError, match="plain qkv product"):
        kernels.vector_gemv(x, w, norm=norm, activation="silu", rotary=fused)
