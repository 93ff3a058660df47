"""AutoAWQ's and GPTQ's packed tensors read into W4A16 weights (quant/w4a16_checkpoint.py).

The readers are fed tensors packed here from known integers the way AutoAWQ
(`WQLinear_GEMM.from_linear`, nibble order 0 2 4 6 1 3 5 7 along N) and AutoGPTQ
(`QuantLinear.pack`: qweight along K, qzeros along N in plain order, zero points less
one in uint32 arithmetic) write them; an act-order checkpoint's g_idx as GPTQ makes it
(each run of G inputs in the quantizer's order one group). Each weight must mean what
the checkpoint means (dequantize, bit for bit) and its products, through the kernels,
x against that weight.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import DEVICE, DTYPES, TOLERANCE, rel_err

pytest.importorskip("triton")

from lmd.engine.turbo.quant.load import fold_down_order
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from lmd.engine.turbo.quant.w4a16_checkpoint import read_awq, read_gptq
from tests.unit.test_turbo_w4a16 import expected_dense, known_ints

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_words(values: Tensor, dim: int, order: list[int]) -> Tensor:
    """Pack 8 consecutive entries along `dim` into an int32, entry order[i] in bits 4 i,
    in uint32 arithmetic (values may be negative, as AutoGPTQ's zeros less one)."""
    moved = values.movedim(dim, -1).long()
    shape = (*moved.shape[:-1], moved.shape[-1] // 8, 8)
    grouped = moved.reshape(shape)
    words = torch.zeros(shape[:-1], dtype=torch.long, device=values.device)
    for i, entry in enumerate(order):
        words |= ((grouped[..., entry] & 0xFFFFFFFF) << (4 * i)) & 0xFFFFFFFF
    signed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return signed.movedim(-1, dim).contiguous()


@pytest.mark.parametrize("group", [128, 64])
def test_from_awq(group: int) -> None:
    n, k = 24, 256
    q, zeros, scales = known_ints(n, k, group)
    qweight = pack_words(q, 1, AWQ_ORDER)  # [K, N / 8]
    qzeros = pack_words(zeros, 1, AWQ_ORDER)  # [K / G, N / 8]
    assert qweight.shape == (k, n // 8) and qzeros.shape == (k // group, n // 8)
    weight = read_awq(qweight, qzeros, scales.half(), group, torch.bfloat16)
    assert weight.dtype == torch.bfloat16 and weight.shape == (n, k)
    assert torch.equal(weight.dequantize(), expected_dense(q, zeros, scales, group))
    with pytest.raises(ValueError, match=rf"AWQ scales is \[{k // group}, 8\]"):
        read_awq(qweight, qzeros, scales[:, :8].half(), group, torch.float16)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2", "sym"])
def test_from_gptq(fmt: str) -> None:
    n, k, group = 16, 384, 128
    q, zeros, scales = known_ints(n, k, group)
    zeros.clamp_(min=1)  # v1 writes a zero of 0 as -1, which spills into the nibbles above,
    zeros[0, 7] = 0  # except in a word's last: nibble 15 there
    if fmt == "sym":
        zeros.fill_(8)
    stored = zeros - 1 if fmt == "gptq" else zeros
    qweight = pack_words(q, 0, list(range(8)))  # [K / 8, N]
    qzeros = pack_words(stored, 1, list(range(8)))  # [K / G, N / 8]
    g_idx = torch.arange(k, device=DEVICE, dtype=torch.int32) // group
    weight = read_gptq(
        qweight,
        None if fmt == "sym" else qzeros,
        scales.half(),
        g_idx,
        group,
        torch.float16,
        fmt == "sym",
        zeros_minus_one=fmt == "gptq",
    )
    assert torch.equal(weight.dequantize(), expected_dense(q, zeros, scales, group))
    assert weight.perm is None
    with pytest.raises(ValueError, match=r"GPTQ qzeros is \[3, 1\]"):
        read_gptq(qweight, qzeros[:, :1], scales, None, group, torch.half, False)


def act_order_groups(k: int, group: int) -> Tensor:
    """g_idx [K] of an act-order (desc_act) GPTQ checkpoint: the quantizer visits the
    inputs in a random order and gives each run of G visited inputs one group."""
    visited = torch.randperm(k, device=DEVICE)
    g_idx = torch.empty(k, dtype=torch.int32, device=DEVICE)
    g_idx[visited] = (torch.arange(k, device=DEVICE) // group).int()
    return g_idx


def expected_by_groups(q: Tensor, zeros: Tensor, scales: Tensor, g_idx: Tensor) -> Tensor:
    """(q - z) * s as [N, K] float32, input k in group g_idx[k]."""
    groups = g_idx.long()
    return ((q.float() - zeros[groups].float()) * scales[groups].float()).t()


class ActOrder(NamedTuple):
    """An act-order GPTQ v2 Linear of known codes (groups of 128): its tensors as stored
    (qweight, qzeros, scales, g_idx) and what they mean, [N, K] float32."""

    qweight: Tensor
    qzeros: Tensor
    scales: Tensor
    g_idx: Tensor
    dense: Tensor

    @classmethod
    def make(cls, n: int, k: int) -> ActOrder:
        q, zeros, scales = known_ints(n, k, 128)
        scales /= 64  # products of a few units: SiLU's exp stays in range
        g_idx = act_order_groups(k, 128)
        qweight, qzeros = pack_words(q, 0, list(range(8))), pack_words(zeros, 1, list(range(8)))
        return cls(qweight, qzeros, scales, g_idx, expected_by_groups(q, zeros, scales, g_idx))

    def read(self, dtype: torch.dtype, scales: Tensor | None = None) -> W4A16Weight:
        scales = self.scales if scales is None else scales
        return read_gptq(
            self.qweight, self.qzeros, scales, self.g_idx, 128, dtype, False, zeros_minus_one=False
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_from_gptq_in_act_order(rows: int, dtype: torch.dtype) -> None:
    """desc_act: the weight means what the checkpoint means, and its products (plain and
    gated) are x against that weight, x gathered into the packed order."""
    k = 384
    linear = ActOrder.make(48, k)
    weight, expected = linear.read(dtype), linear.dense
    assert weight.perm is not None
    assert torch.equal(weight.dequantize(), expected)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    assert rel_err(weight.matmul(x), x.float() @ expected.t()) < TOLERANCE[dtype]
    gate_up = W4A16Weight.cat([weight, linear.read(dtype, linear.scales / 2)])  # up: gate / 2
    product = x.float() @ expected.t()
    gated = F.silu(product) * (product * 0.5)
    assert rel_err(gate_up.matmul(x, activation="silu"), gated) < 2 * TOLERANCE[dtype]


def test_act_order_refusals() -> None:
    group = 128
    qweight, qzeros, scales, g_idx, _ = ActOrder.make(16, 256)
    uneven = g_idx.clone()
    uneven[g_idx == 0] = 1  # every input in group 1
    with pytest.raises(ValueError, match="does not put 128 inputs in each of its 2 groups"):
        read_gptq(qweight, qzeros, scales, uneven, group, torch.float16, False)
    with pytest.raises(ValueError, match=r"g_idx is \[255\]"):
        read_gptq(qweight, qzeros, scales, g_idx[1:], group, torch.float16, False)
    ordered = read_gptq(qweight, qzeros, scales, g_idx, group, torch.float16, False)
    plain = read_gptq(qweight, qzeros, scales, None, group, torch.float16, False)
    with pytest.raises(ValueError, match="act orders"):
        W4A16Weight.cat([ordered, plain])


def test_down_order_folded_into_gate_up_changes_no_output() -> None:
    """fold_down_order: down reads its inputs as gate|up now makes them (no gather), and
    the MLP's output, bias included, is what it was."""
    dtype = torch.float32
    hidden, width = 256, 384  # two and three groups of 128
    gate_up = ActOrder.make(2 * width, hidden).read(dtype)
    down = ActOrder.make(hidden, width).read(dtype)
    bias = torch.randn(2 * width, device=DEVICE)
    x = torch.randn(5, hidden, device=DEVICE)

    def mlp(gu: W4A16Weight, b: Tensor, d: W4A16Weight) -> Tensor:
        gate, up = gu.matmul(x, b).chunk(2, dim=-1)
        return d.matmul(F.silu(gate) * up)

    folded_gate_up, folded_bias, folded_down = fold_down_order(gate_up, bias, down)
    assert isinstance(folded_gate_up, W4A16Weight) and isinstance(folded_down, W4A16Weight)
    assert folded_down.perm is None and folded_bias is not None
    # gate|up's own inputs keep their order; only its outputs move
    assert gate_up.perm is not None and folded_gate_up.perm is gate_up.perm
    got = mlp(folded_gate_up, folded_bias, folded_down)
    assert rel_err(got, mlp(gate_up, bias, down)) < TOLERANCE[dtype]
