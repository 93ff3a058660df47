"""A layer of experts for one token (kernels/moe_vector.py) against a float32 loop over
its experts, against kernels/moe.py's path, vector_gemv's `experts` row by row against
the same product with each expert's weights alone (bit for bit: the same kernel, tiles
and order), and the experts its router's launch chooses (a `Route`) against the top-k
kernel's on the same logits. Through Triton's interpreter without CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import DEVICE, DTYPES, TOLERANCE, rel_err

pytest.importorskip("triton")

from lmd.engine.turbo.kernels import moe, moe_vector, rms_norm, routing
from lmd.engine.turbo.kernels.vector_gemv import Norm, Route, vector_gemv
from tests.unit.test_turbo_moe import moe_ref

HIDDEN, INTER = 64, 48  # 2I = 96: not a multiple of the column tiles


def layer(
    dtype: torch.dtype, num_experts: int, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hidden [1, H], residual [1, H], norm weight [H], router, gate_up, down."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    return (
        rand(1, HIDDEN),
        rand(1, HIDDEN),
        1 + rand(HIDDEN, scale=0.2),
        rand(num_experts, HIDDEN),
        rand(num_experts, 2 * INTER, HIDDEN, scale=1 / 8),
        rand(num_experts, HIDDEN, INTER, scale=1 / 8),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_experts", "top_k", "normalize"), [(8, 2, True), (16, 4, False), (4, 1, True)]
)
def test_one_token_through_its_experts_equals_the_loop(
    dtype: torch.dtype, num_experts: int, top_k: int, normalize: bool
) -> None:
    hidden, residual, norm, router, gate_up, down = layer(dtype, num_experts, top_k)
    summed = torch.empty_like(residual)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = moe_vector.experts_vector(
        hidden,
        Norm(norm, 1e-6, residual, summed),
        router,
        gate_up,
        down,
        top_k=top_k,
        normalize=normalize,
        count=count,
    )
    assert out.shape == (1, HIDDEN) and out.dtype == dtype and count.item() == 0
    assert torch.equal(summed, (hidden.float() + residual.float()).to(dtype))
    h = rms_norm(hidden, norm, 1e-6, residual.clone())
    ref = moe_ref(h, router, gate_up, down, top_k, normalize)
    # Rounded where moe.py's path rounds (gate/up, the activation, each expert's share).
    assert rel_err(out, ref) < 4 * TOLERANCE[dtype]
    grouped = moe.fused_moe(h, router, gate_up, down, top_k=top_k, normalize=normalize)
    assert rel_err(out, grouped.float()) < 4 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_experts_row_is_the_product_with_that_expert_alone(dtype: torch.dtype) -> None:
    hidden, residual, norm, _, gate_up, _ = layer(dtype, 6, 9)
    experts = torch.tensor([4, 0, 5], dtype=torch.int32, device=DEVICE)
    fold = Norm(norm, 1e-6, residual)
    rows = vector_gemv(hidden, gate_up, norm=fold, activation="silu", experts=experts)
    assert rows.shape == (3, INTER)
    for c, e in enumerate(experts.tolist()):
        alone = vector_gemv(hidden, gate_up[e], norm=fold, activation="silu")
        assert torch.equal(rows[c : c + 1], alone), c
    plain = vector_gemv(hidden, gate_up, experts=experts)  # no norm, no activation
    for c, e in enumerate(experts.tolist()):
        assert torch.equal(plain[c : c + 1], vector_gemv(hidden, gate_up[e])), c


@pytest.mark.parametrize("tiles", [None, (2, 16, 4, 2)], ids=["default", "tiles"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mix_down_sums_the_weighted_experts(
    dtype: torch.dtype, tiles: tuple[int, int, int, int] | None
) -> None:
    *_, down = layer(dtype, 5, 10)
    gen = torch.Generator().manual_seed(11)
    act = torch.randn(3, INTER, generator=gen).to(dtype).to(DEVICE)
    experts = torch.tensor([2, 4, 0], dtype=torch.int32, device=DEVICE)
    weights = torch.tensor([0.5, 0.3, 0.2], device=DEVICE)
    out = moe_vector.mix_down(act, down, experts, weights, tiles)
    ref = sum(
        w * (down[e].float() @ a.float())
        for w, e, a in zip(weights.tolist(), experts.tolist(), act, strict=True)
    )
    assert isinstance(ref, Tensor)
    assert out.shape == (1, HIDDEN) and rel_err(out[0], ref) < 2 * TOLERANCE[dtype]


def new_route(top_k: int, normalize: bool) -> Route:
    return Route(
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
        torch.empty(top_k, device=DEVICE),
        torch.empty(top_k, dtype=torch.int32, device=DEVICE),
        normalize,
    )


@pytest.mark.parametrize("tiles", [(4, 16, 4, 2), (64, 64, 4, 2)], ids=["programs", "one"])
@pytest.mark.parametrize(("num_experts", "top_k", "normalize"), [(40, 8, True), (8, 2, False)])
def test_the_routers_launch_chooses_the_top_k_kernels_experts(
    num_experts: int, top_k: int, normalize: bool, tiles: tuple[int, int, int, int]
) -> None:
    hidden, residual, norm, router, *_ = layer(torch.float32, num_experts, 13)
    fold = Norm(norm, 1e-6, residual)
    route = new_route(top_k, normalize)
    logits = vector_gemv(hidden, router, norm=fold, out_dtype=torch.float32, route=route)
    assert torch.equal(logits, vector_gemv(hidden, router, norm=fold, out_dtype=torch.float32))
    weights, experts = routing.top_k_of(logits, top_k, normalize)
    assert torch.equal(route.experts, experts[0]) and torch.equal(route.weights, weights[0])
    assert route.count.item() == 0  # left for the next launch
    vector_gemv(hidden, router, norm=fold, out_dtype=torch.float32, route=route, tiles=tiles)
    assert torch.equal(route.experts, experts[0]) and route.count.item() == 0


@pytest.mark.parametrize("normalize", [True, False])
def test_top_k_is_the_softmaxs_largest_the_lowest_id_first_among_equals(normalize: bool) -> None:
    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(5, 128, generator=gen)
    logits[1, [3, 70, 9, 100]] = 7.0  # four equal largest: ids 3, 9, 70, 100 in that order
    logits[2] = 0.5  # all equal
    weights, experts = routing.top_k_of(logits.to(DEVICE), 8, normalize)
    probs = torch.softmax(logits, dim=-1)
    order = sorted(range(128), key=lambda e: (-float(logits[1, e]), e))
    assert experts[1].tolist() == order[:8] and experts[2].tolist() == list(range(8))
    want_p, want_e = probs.topk(8, dim=-1)
    assert torch.equal(experts[[0, 3, 4]].cpu(), want_e[[0, 3, 4]].to(torch.int32))
    if normalize:
        want_p = want_p / want_p.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights.cpu(), want_p, rtol=1e-6, atol=1e-7)


def test_bad_shapes_are_refused() -> None:
    hidden, _, _, _, gate_up, down = layer(torch.float32, 4, 12)
    experts = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="experts"):
        vector_gemv(hidden, gate_up[0], experts=experts)  # 2-D weights
    with pytest.raises(ValueError, match="experts"):
        vector_gemv(hidden, gate_up, experts=experts.long())
    with pytest.raises(ValueError, match="bias"):
        vector_gemv(hidden, gate_up, torch.zeros(2 * INTER, device=DEVICE), experts=experts)
    router = gate_up[:, 0]  # [E, H]
    with pytest.raises(ValueError, match="route"):  # logits not float32
        vector_gemv(hidden, router, route=new_route(2, True))
    bad = dataclasses.replace(new_route(2, True), count=torch.zeros(1, device=DEVICE))
    with pytest.raises(ValueError, match="route"):  # a float counter
        vector_gemv(hidden, router, out_dtype=torch.float32, route=bad)
    with pytest.raises(ValueError, match="route"):  # more choices than experts
        vector_gemv(hidden, router, out_dtype=torch.float32, route=new_route(5, True))
    with pytest.raises(ValueError, match="top_k"):
        routing.top_k_of(torch.zeros(1, 4, device=DEVICE), 5, True)
    act = torch.zeros(2, INTER + 1, device=DEVICE)
    with pytest.raises(ValueError, match="mix_down"):
        moe_vector.mix_down(act, down, experts, torch.ones(2, device=DEVICE))
