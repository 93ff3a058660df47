"""kernels/cache_write.py: new tokens' K and V into their slots of the paged pool,
nothing else touched, padding rows (slot -1) skipped. Through Triton's interpreter
without CUDA, compiled with it."""

from __future__ import annotations

import pytest
import torch

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import DEVICE, DTYPES

pytest.importorskip("triton")

from lmd.engine.turbo import kernels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kv_heads", "head_dim", "block_size"), [(2, 16, 4), (3, 64, 16)])
def test_cache_write_fills_the_slots_and_skips_padding(
    dtype: torch.dtype, kv_heads: int, head_dim: int, block_size: int
) -> None:
    num_tokens, num_blocks, layers, layer = 9, 8, 3, 2
    # Heads-first views, as transformers hands them over ([1, Hkv, T, D] transposed).
    k = torch.randn(kv_heads, num_tokens, head_dim, device=DEVICE).to(dtype).transpose(0, 1)
    v = torch.randn(kv_heads, num_tokens, head_dim, device=DEVICE).to(dtype).transpose(0, 1)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[[2, 7]] = -1  # padding rows of a graph's bucket
    kv = torch.full(
        (num_blocks, layers, 2, block_size, kv_heads, head_dim), float("nan"), device=DEVICE
    ).to(dtype)
    kernels.cache_write(k, v, slots, kv, layer)
    real = slots >= 0
    blocks, offsets = slots[real] // block_size, slots[real] % block_size
    assert torch.equal(kv[blocks, layer, 0, offsets], k[real])
    assert torch.equal(kv[blocks, layer, 1, offsets], v[real])
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    written[blocks, offsets] = True
    assert kv[:, layer].transpose(1, 2)[~written].isnan().all()
    assert kv[:, :layer].isnan().all()


def test_cache_write_refuses_a_pool_of_other_heads() -> None:
    k = torch.zeros(3, 2, 16, device=DEVICE)
    kv = torch.zeros(4, 1, 2, 4, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        kernels.cache_write(k, k, torch.zeros(3, dtype=torch.int64, device=DEVICE), kv, 0)
