"""BlockManager: allocation, growth, reference counts, prefix cache, no leaks."""

from __future__ import annotations

import pytest

from lmd.engine.block_manager import BlockManager
from lmd.engine.sequence import Sequence

BS = 4


def seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens)


def test_allocate_takes_ceil_blocks_and_free_returns_them() -> None:
    bm = BlockManager(10, BS)
    s = seq("a", list(range(9)))  # 9 tokens -> 3 blocks
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert s.block_table == [0, 1, 2]  # a fresh pool hands out a contiguous run
    assert (bm.num_free_blocks, bm.num_used_blocks) == (7, 3)
    assert s.num_cached_tokens == 0
    bm.free(s)
    assert s.block_table == []
    assert bm.num_free_blocks == bm.num_total_blocks == 10


def test_free_twice_is_a_no_op() -> None:
    bm = BlockManager(4, BS)
    s = seq("a", [1, 2, 3, 4, 5])
    bm.allocate(s)
    bm.free(s)
    bm.free(s)
    assert bm.num_free_blocks == 4


def test_allocation_beyond_free_blocks_is_refused() -> None:
    bm = BlockManager(2, BS)
    big = seq("big", list(range(9)))  # needs 3 blocks
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError, match="needs more blocks than are free"):
        bm.allocate(big)
    assert bm.num_free_blocks == 2


def test_allocating_a_sequence_that_holds_blocks_is_refused() -> None:
    bm = BlockManager(4, BS)
    s = seq("a", [1])
    bm.allocate(s)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        bm.allocate(s)


def test_append_adds_a_block_only_when_the_last_is_full() -> None:
    bm = BlockManager(3, BS)
    s = seq("a", [1, 2, 3, 4])
    bm.allocate(s)
    assert len(s.block_table) == 1
    s.output_token_ids.append(5)  # 5th token: the first block is full
    assert bm.can_append(s)
    bm.append(s)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 1
    for token in (6, 7, 8):
        s.output_token_ids.append(token)
        bm.append(s)
    assert len(s.block_table) == 2  # tokens 5..8 fit in block 2


def test_append_without_a_free_block_is_refused() -> None:
    bm = BlockManager(1, BS)
    s = seq("a", [1, 2, 3, 4])
    bm.allocate(s)
    s.output_token_ids.append(5)
    assert not bm.can_append(s)
    with pytest.raises(RuntimeError, match="cannot grow: no free block"):
        bm.append(s)


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """What a prefill step does: every token's KV is now in the blocks."""
    s.num_cached_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_prefix_hit_reuses_full_blocks_and_skips_their_tokens() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    shared = [7, 7, 7, 7, 8, 8, 8, 8]
    a = seq("a", [*shared, 1, 2])
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2  # the two full blocks; the partial one is not cached
    b = seq("b", [*shared, 3])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_tokens == b.num_prefix_cached_tokens == 8
    assert bm.ref_count(a.block_table[0]) == 2
    assert bm.num_used_blocks == 4  # 3 for a + 1 new for b
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_different_first_block_breaks_the_hash_chain() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = seq("a", [1, 1, 1, 1, 2, 2, 2, 2, 9])
    bm.allocate(a)
    compute_all(bm, a)
    # Same second block, different first block: no hit on block 2 either.
    b = seq("b", [3, 3, 3, 3, 2, 2, 2, 2, 9])
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert set(b.block_table).isdisjoint(a.block_table)


def test_the_last_token_is_never_a_hit() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(a)
    compute_all(bm, a)
    same = seq("same", [1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(same)
    # Its logits are needed, so the block holding the last token is computed again.
    assert same.num_cached_tokens == 4
    assert same.block_table[0] == a.block_table[0]
    assert same.block_table[1] != a.block_table[1]


def test_uncomputed_blocks_are_not_served_from_the_cache() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a)  # allocated, but no step has run yet
    b = seq("b", [1, 2, 3, 4, 5])
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_freed_cached_blocks_are_free_yet_still_hit() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4  # the cached block counts as free (evictable)
    b = seq("b", [1, 2, 3, 4, 6])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert bm.num_free_blocks == 2


def test_lru_eviction_drops_the_least_recently_freed_block() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    old = seq("old", [1, 1, 1, 1, 0])
    new = seq("new", [2, 2, 2, 2, 0])
    for s in (old, new):
        bm.allocate(s)
        compute_all(bm, s)
    bm.free(old)
    bm.free(new)
    # Free now: two evictable cached prefix blocks and two uncached tail blocks.
    filler = seq("filler", [9] * 12)  # 3 blocks: both uncached ones, then evict one
    bm.allocate(filler)
    bm.free(filler)
    hit_new = seq("hit_new", [2, 2, 2, 2, 5])
    bm.allocate(hit_new)
    assert hit_new.num_cached_tokens == 4  # the most recently freed prefix survived
    hit_old = seq("hit_old", [1, 1, 1, 1, 5])
    bm.allocate(hit_old)
    assert hit_old.num_cached_tokens == 0  # the least recently freed was evicted
    bm.free(hit_new)
    bm.free(hit_old)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_can_allocate_counts_evictable_hits_as_taken() -> None:
    bm = BlockManager(2, BS, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    # 3 blocks needed: 1 hit (evictable) + 2 new, but only 2 exist.
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert not bm.can_allocate(b)


def test_decode_blocks_become_cached_as_they_fill() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3])
    bm.allocate(a)
    compute_all(bm, a)
    for token in (4, 5, 6):  # decode: append, then the step computes the token
        a.output_token_ids.append(token)
        bm.append(a)
        compute_all(bm, a)
    assert bm.num_cached_blocks == 1
    bm.free(a)
    again = seq("again", [1, 2, 3, 4, 5, 6])
    bm.allocate(again)
    assert again.num_cached_tokens == 4


def test_shared_blocks_survive_one_owner_freeing() -> None:
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    b = seq("b", [1, 2, 3, 4, 6])
    bm.allocate(b)
    bm.free(a)
    assert bm.ref_count(b.block_table[0]) == 1
    filler = seq("filler", [9] * 12)  # takes every other free block, never b's prefix
    bm.allocate(filler)
    assert b.block_table[0] not in filler.block_table
    bm.free(b)
    bm.free(filler)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_duplicate_computations_keep_one_cached_copy_and_leak_nothing() -> None:
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    b = seq("b", [1, 2, 3, 4, 5])
    bm.allocate(a)
    bm.allocate(b)  # both computed the same block in the same step
    compute_all(bm, a)
    compute_all(bm, b)
    assert bm.num_cached_blocks == 1
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks
    c = seq("c", [1, 2, 3, 4, 7])
    bm.allocate(c)
    assert c.num_cached_tokens == 4


def test_blocks_behind_a_sliding_window_go_back_to_the_pool() -> None:
    bm = BlockManager(10, BS, window=8)
    s = seq("a", list(range(21)))
    bm.allocate(s)  # 6 blocks for 21 tokens
    s.num_cached_tokens = 20  # the next query is at position 20: it sees keys 13..20
    # Blocks 0-2 (keys 0..11) are out of every later query's sight; block 3 (12..15) has 13.
    assert bm.release_behind_window(s) == 3
    assert s.block_table[:3] == [0, 0, 0] and bm.num_used_blocks == 3
    assert bm.release_behind_window(s) == 0  # nothing more until the query moves on
    s.num_cached_tokens = 24
    assert bm.release_behind_window(s) == 1
    bm.free(s)  # only what it still holds: nothing freed twice
    assert bm.num_free_blocks == bm.num_total_blocks


def test_without_a_window_nothing_is_released() -> None:
    bm = BlockManager(10, BS)
    s = seq("a", list(range(21)))
    bm.allocate(s)
    s.num_cached_tokens = 20
    assert bm.release_behind_window(s) == 0 and bm.num_used_blocks == 6


def test_with_prefix_caching_the_last_hashed_block_stays_for_the_chain() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=True, window=4)
    s = seq("a", list(range(21)))
    bm.allocate(s)
    s.num_cached_tokens = 12
    bm.cache_full_blocks(s)  # blocks 0-2 hashed
    # Keys 0..8 are out of sight (blocks 0, 1 whole), but block 2 chains block 3's hash.
    assert bm.release_behind_window(s) == 2
    s.num_cached_tokens = 20
    bm.cache_full_blocks(s)  # block 3 and 4 hashed on block 2's digest: still held
    assert bm.release_behind_window(s) == 2  # blocks 2, 3; block 4 chains what comes next
    twin = seq("b", list(range(21)))
    assert bm.can_allocate(twin)
    bm.allocate(twin)  # the released blocks are still cached: a full prefix hit
    assert twin.num_cached_tokens == 20
    bm.free(s)
    bm.free(twin)
    assert bm.num_free_blocks == bm.num_total_blocks
