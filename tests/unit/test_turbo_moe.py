"""The experts' kernels (kernels/moe.py) against a loop over experts in float32.

`align` must place every (token, choice) pair exactly once, in blocks of one expert
each; the grouped GEMMs and `fused_moe` must equal running each token through its k
experts one by one, and gate|up's GEMM with the activation made in its launch the two
launches' values, bit for bit when compiled (one rounding apart in the interpreter).
Through Triton's interpreter without CUDA, compiled with it.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import DEVICE, DTYPES, ON_CUDA, TOLERANCE, rel_err

pytest.importorskip("triton")

from lmd.engine.turbo.kernels import moe, moe_align, silu_and_mul


def moe_ref(  # noqa: PLR0917
    h: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, k: int, norm: bool
) -> Tensor:
    """transformers' loop: each token through each of its k experts, weighted, summed."""
    h, router, gate_up, down = (t.float() for t in (h, router, gate_up, down))
    probs = torch.softmax(h @ router.t(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(k):
            e = int(experts[t, j])
            gate, up = (gate_up[e] @ h[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [
        (1, 8, 2, 16),
        (3, 128, 8, 16),
        (40, 4, 2, 16),
        (200, 16, 4, 32),
        (64, 8, 1, 64),
        (300, 128, 8, 128),  # 2,400 pairs: 10 programs count, 10 place and pad
        (700, 8, 2, 16),
    ],
)
def test_align_places_every_pair_once_in_blocks_of_one_expert(
    num_tokens: int, num_experts: int, top_k: int, block_m: int
) -> None:
    generator = torch.Generator().manual_seed(num_tokens)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    experts = scores.topk(top_k, dim=-1).indices.to(DEVICE)  # distinct per token
    sorted_pairs, block_expert = moe_align.align(experts, num_experts, block_m)
    num_pairs = num_tokens * top_k
    assert sorted_pairs.shape[0] == block_expert.shape[0] * block_m
    pairs = sorted_pairs.cpu().view(-1, block_m)
    owner = block_expert.cpu()
    flat = experts.flatten().cpu()
    seen: list[int] = []
    for block, expert in zip(pairs.tolist(), owner.tolist(), strict=True):
        real = [p for p in block if p < num_pairs]
        if expert < 0:
            assert not real  # blocks past the last run hold only padding
            continue
        assert all(p == num_pairs for p in block[len(real) :])  # padding at the end
        assert all(int(flat[p]) == expert for p in real)
        seen.extend(real)
    assert sorted(seen) == list(range(num_pairs))
    used = owner[owner >= 0].tolist()
    assert used == sorted(used)  # runs in expert order, each expert's blocks together


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "norm"),
    [(1, 8, 2, True), (5, 16, 4, False), (37, 4, 2, True), (130, 8, 2, False), (300, 4, 2, True)],
)
def test_fused_moe_equals_the_loop_over_experts(  # noqa: PLR0917
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    num_tokens: int,
    num_experts: int,
    top_k: int,
    norm: bool,
) -> None:
    hidden, inter = 64, 48  # 2I = 96: not a multiple of the 64-wide column blocks
    torch.manual_seed(num_tokens)
    # the activation in gate|up's launch (GATED_GEMM) at odd token counts, its own at even
    monkeypatch.setattr(moe, "GATED_GEMM", num_tokens % 2 == 1)
    h = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    router = torch.randn(num_experts, hidden, device=DEVICE).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / 8).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, device=DEVICE) / 8).to(dtype)
    out = moe.fused_moe(h, router, gate_up, down, top_k=top_k, normalize=norm)
    assert out.shape == h.shape and out.dtype == dtype
    ref = moe_ref(h, router, gate_up, down, top_k, norm)
    # Rounded at the expert boundaries (gate/up, the activation) as well as at the end.
    assert rel_err(out, ref) < 4 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "tiles"), [(6, None), (300, None), (40, (32, 32, 4, 2))])
def test_gate_up_with_its_activation_gives_the_two_launches_values(
    dtype: torch.dtype, num_tokens: int, tiles: tuple[int, int, int, int] | None
) -> None:
    num_experts, top_k, hidden, inter = 8, 2, 64, 40  # 2I = 80: a partial column tile
    torch.manual_seed(num_tokens)
    h = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / 8).to(dtype)
    experts = torch.randint(0, num_experts, (num_tokens, top_k), device=DEVICE)
    num_pairs = num_tokens * top_k
    block_m = moe_align.block_rows(num_pairs, num_experts)
    layout = moe_align.align(experts, num_experts, block_m)
    gemm = partial(
        moe.grouped_gemm, num_pairs=num_pairs, a_row_div=top_k, block_m=block_m, tiles=tiles
    )
    both = gemm(h, gate_up, *layout)  # [P, 2I]
    act = gemm(h, gate_up, *layout, gated=True)
    assert act.shape == (num_pairs, inter)
    ref = silu_and_mul(both)
    if ON_CUDA:  # compiled: a column's sums are the same tiles' either way
        assert torch.equal(act, ref)
    else:  # the interpreter's dots are numpy's matmul, whose BLAS may add a column's
        # products in another order where gate and up columns are interleaved: one
        # rounding of the sums apart (seen on OpenBLAS 0.3.31, 2026-12-01)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(act, ref, rtol=8 * eps, atol=8 * eps * float(ref.abs().max()))
    with pytest.raises(ValueError, match="gated"):
        gemm(h, gate_up[:, 1:], *layout, gated=True)


def test_fused_moe_of_no_tokens_is_empty() -> None:
    h = torch.empty(0, 32, device=DEVICE)
    out = moe.fused_moe(
        h,
        torch.randn(4, 32, device=DEVICE),
        torch.randn(4, 16, 32, device=DEVICE),
        torch.randn(4, 32, 8, device=DEVICE),
        top_k=2,
        normalize=True,
    )
    assert out.shape == (0, 32)


def test_block_rows_grow_with_the_rows_per_expert() -> None:
    assert moe_align.block_rows(8, 128) == 16  # a decode step: a few rows per expert
    assert moe_align.block_rows(64 * 8, 8) == 64  # a short prefill: many
    assert moe_align.block_rows(4096 * 8, 128) == 128  # a prefill chunk of Qwen3-30B-A3B
    assert moe_align.block_rows(3 * 128, 8) == 32
