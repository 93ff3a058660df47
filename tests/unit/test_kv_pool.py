"""KVPool layout and sizing: block-major, contiguous blocks, LMDeploy semantics."""

from __future__ import annotations

import mmap

import pytest
import torch

from lmd.engine.kv_layout import bytes_per_block
from lmd.engine.kv_pool import (
    CPU_KV_CAP_BYTES,
    KVPool,
    PoolBuffer,
    cpu_free_bytes,
    cpu_kv_free,
    num_blocks_for,
)

BLOCK_NBYTES = 3 * 2 * 4 * 2 * 8 * 4  # L * (k, v) * S * Hkv * D * fp32 = 1536


def make_pool(
    num_blocks: int, dtype: torch.dtype = torch.float32, buffer: PoolBuffer | None = None
) -> KVPool:
    return KVPool(
        num_blocks,
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        dtype=dtype,
        buffer=buffer,
    )


def test_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    assert bytes_per_block(3, 2, 8, 4, torch.float32) == BLOCK_NBYTES
    # Llama-3-8B: 32 layers, 8 kv heads, 128 dims, 64 tokens, bf16 = 8 MiB per block.
    assert bytes_per_block(32, 8, 128, 64, torch.bfloat16) == 8 << 20


def test_fraction_takes_that_share_of_free_memory() -> None:
    assert num_blocks_for(0.5, free_bytes=10_000, bytes_per_block=1000) == 5
    assert num_blocks_for(1.0, free_bytes=10_999, bytes_per_block=1000) == 10


def test_int_is_a_block_count() -> None:
    assert num_blocks_for(7, free_bytes=10_000, bytes_per_block=1000) == 7


@pytest.mark.parametrize(
    ("count", "free", "message"),
    [
        (11, 10_000, "cache_max_entry_count=11 blocks need"),
        (0, 10_000, "as a block count must be > 0, got 0"),
        (1.5, 10_000, r"as a fraction must be in \(0, 1\], got 1.5"),
        (0.01, 10_000, "holds no"),
    ],
)
def test_sizing_errors_say_what_to_change(count: float, free: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        num_blocks_for(count, free_bytes=free, bytes_per_block=1000)


def test_cpu_budget_is_a_capped_share_of_available_ram() -> None:
    assert cpu_free_bytes(8 << 30) == 4 << 30
    assert cpu_free_bytes(64 << 30) == 4 << 30  # capped
    assert cpu_free_bytes(1 << 30, share=0.25) == 256 << 20


def test_cpu_pools_added_by_scaling_stay_within_the_cap() -> None:
    """lmdctl scale decode 2 on CPU: prefill-0 and decode-0 took 1.6 GiB each (0.8 of their
    half of the 4 GiB cap); decode-1, sized from what it alone saw, added 1.2 GiB more and
    the pools reached 4.4 GiB. Sized from what the cap leaves, every pool fits in it."""
    block = 2_949_120  # SmolLM2-135M, fp32, 64 tokens: 2.8 MiB
    available = 24 << 30
    pools: list[int] = []
    for _ in range(7):  # prefill-0 and decode-0 start together, then one more at a time
        free = cpu_kv_free(available, num_engines=2, taken_bytes=sum(pools))
        pools.append(num_blocks_for(0.8, free, block) * block)
    # As before for the first two (1.6 GiB each); then 0.8 of what the cap leaves.
    assert [p // block for p in pools] == [582, 582, 233, 47, 9, 2, 1]
    assert sum(pools) <= CPU_KV_CAP_BYTES
    with pytest.raises(ValueError, match="holds no"):  # the cap is spent: one line says so
        num_blocks_for(0.8, cpu_kv_free(available, 2, taken_bytes=sum(pools)), block)
    # An integer block count must fit in what is left, as on a GPU.
    free = cpu_kv_free(available, 2, taken_bytes=2 * 582 * block)
    with pytest.raises(ValueError, match="lower it or pass a fraction"):
        num_blocks_for(582, free, block)


def test_cpu_kv_free_is_an_even_share_within_the_cap() -> None:
    assert cpu_kv_free(24 << 30, 2) == 2 << 30  # half of the 4 GiB cap each
    assert cpu_kv_free(4 << 30, 2) == 1 << 30  # half of half the available RAM
    assert cpu_kv_free(24 << 30, 2, taken_bytes=3 << 30) == 1 << 30  # what the cap leaves
    assert cpu_kv_free(24 << 30, 2, taken_bytes=5 << 30) == 0  # over it already


def test_pool_is_one_block_major_allocation() -> None:
    pool = make_pool(5)
    assert tuple(pool.kv.shape) == (5, 3, 2, 4, 2, 8)
    assert pool.kv.is_contiguous()
    assert pool.block_nbytes == BLOCK_NBYTES
    assert pool.nbytes == 5 * BLOCK_NBYTES
    assert bool((pool.kv == 0).all())


def test_block_offset_addresses_the_whole_block() -> None:
    pool = make_pool(5)
    pool.block(3).fill_(1.0)
    raw = pool.as_bytes()
    offset = pool.block_offset(3)
    assert offset == 3 * BLOCK_NBYTES
    one_block = raw[offset : offset + pool.block_nbytes].view(torch.float32)
    assert bool((one_block == 1.0).all())
    assert float(pool.kv.sum()) == BLOCK_NBYTES // 4  # nothing outside block 3 changed


def test_layer_views_write_into_the_pool() -> None:
    pool = make_pool(2)
    k, v = pool.layer(1)
    assert tuple(k.shape) == (2, 4, 2, 8)
    v[1, 2] = 5.0  # block 1, slot 2 of layer 1's values
    assert bool((pool.kv[1, 1, 1, 2] == 5.0).all())
    assert float(pool.kv.sum()) == 5.0 * 2 * 8


def test_consecutive_blocks_merge_into_one_range() -> None:
    pool = make_pool(8)
    b = BLOCK_NBYTES
    assert pool.contiguous_ranges([2, 3, 4, 7, 0]) == [(2 * b, 3 * b), (7 * b, b), (0, b)]
    assert pool.contiguous_ranges([]) == []


def test_out_of_range_block_is_refused() -> None:
    pool = make_pool(2)
    with pytest.raises(IndexError, match=r"block 2 out of range 0\.\.1"):
        pool.block_offset(2)


def test_pool_over_caller_memory_shares_it() -> None:
    with mmap.mmap(-1, 4 * BLOCK_NBYTES) as shared:
        pool = make_pool(4, buffer=shared)
        pool.block(1).fill_(2.0)
        first = torch.frombuffer(shared, dtype=torch.float32, count=1, offset=BLOCK_NBYTES)
        assert float(first[0]) == 2.0
        del pool, first


def test_pool_over_a_flat_tensor() -> None:
    elements_per_block = BLOCK_NBYTES // 4  # same count in bf16, half the bytes
    flat = torch.zeros(4 * elements_per_block, dtype=torch.bfloat16)
    pool = make_pool(4, torch.bfloat16, flat)
    assert pool.block_nbytes == BLOCK_NBYTES // 2
    pool.block(0).fill_(1.0)
    assert pool.data_ptr == flat.data_ptr()
    assert float(flat.float().sum()) == elements_per_block


def test_too_small_or_read_only_buffers_are_refused() -> None:
    with pytest.raises(ValueError, match="buffer holds 100 bytes but 1 blocks need 1536"):
        make_pool(1, buffer=bytearray(100))
    with pytest.raises(ValueError, match="buffer is read-only"):
        make_pool(1, buffer=memoryview(bytes(BLOCK_NBYTES)))
