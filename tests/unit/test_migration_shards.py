"""The copies between KV pools of tensor-parallel groups (migration/shards.py): applied to
real byte arrays, every destination rank ends up with exactly its heads of the blocks
the prompt's KV fills, for groups of equal and of different sizes, 16-bit and quantized
layouts; nothing else is written."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lmd.migration.shards import BlockLayout, Shard, shard_copies

LAYOUTS = {
    "bf16": BlockLayout(num_heads=4, rows=2 * 2 * 3, units=(8 * 2,)),  # L 2, S 3, D 8
    "int8+scales": BlockLayout(num_heads=4, rows=2 * 2 * 3, units=(8, 2)),
}


def _split(whole: np.ndarray, layout: BlockLayout, size: int) -> list[np.ndarray]:
    """A whole pool [blocks, bytes] as each rank of `size` holds it."""
    per = layout.num_heads // size
    ranks = []
    for rank in range(size):
        blocks = []
        for block in whole:
            parts, at = [], 0
            for unit in layout.units:
                part = block[at : at + layout.rows * layout.num_heads * unit]
                rows = part.reshape(layout.rows, layout.num_heads, unit)
                parts.append(rows[:, rank * per : (rank + 1) * per].ravel())
                at += part.size
            blocks.append(np.concatenate(parts))
        ranks.append(np.stack(blocks))
    return ranks


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize(("src_size", "dst_size"), [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (1, 4)])
def test_every_rank_gets_its_heads_of_the_migrated_blocks(
    kind: str, src_size: int, dst_size: int
) -> None:
    layout = LAYOUTS[kind]
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 255, size=(6, layout.nbytes()), dtype=np.uint8)
    sources = _split(whole, layout, src_size)
    src_ids, dst_ids = [4, 0, 1, 2], [1, 2, 3, 5]  # a run (0 1 2 -> 2 3 ... ) and a jump
    dests = [np.zeros((7, layout.nbytes(dst_size)), dtype=np.uint8) for _ in range(dst_size)]
    for s, d in itertools.product(range(src_size), range(dst_size)):
        src, dst = sources[s].ravel(), dests[d].reshape(-1)
        for src_off, dst_off, length in shard_copies(
            layout, src_ids, dst_ids, Shard(s, src_size), Shard(d, dst_size)
        ):
            assert dst_off + length <= dst.size and src_off + length <= src.size
            dst[dst_off : dst_off + length] = src[src_off : src_off + length]
    expected = _split(whole, layout, dst_size)
    for d in range(dst_size):
        np.testing.assert_array_equal(dests[d][dst_ids], expected[d][src_ids])
        untouched = [b for b in range(7) if b not in dst_ids]
        assert not dests[d][untouched].any()


def test_equal_groups_copy_whole_blocks_rank_to_rank_in_runs() -> None:
    layout = LAYOUTS["bf16"]
    copies = shard_copies(layout, [0, 1, 2, 7], [3, 4, 5, 0], Shard(1, 2), Shard(1, 2))
    per = layout.nbytes(2)
    assert copies == [(0, 3 * per, 3 * per), (7 * per, 0, per)]
    assert shard_copies(layout, [0], [0], Shard(0, 2), Shard(1, 2)) == []


def test_different_groups_copy_rows_and_merge_what_is_contiguous() -> None:
    layout = LAYOUTS["bf16"]
    # rank 0 of 2 -> rank 0 of 4: one head of its two per row, rows apart
    rows = shard_copies(layout, [0], [0], Shard(0, 2), Shard(0, 4))
    assert len(rows) == layout.rows and all(length == 16 for _, _, length in rows)
    # rank 1 of 4 -> rank 0 of 2 holds no head of rank 2 of 4's
    assert shard_copies(layout, [0], [0], Shard(2, 4), Shard(0, 2)) == []


def test_heads_that_do_not_split_are_refused() -> None:
    layout = BlockLayout(num_heads=2, rows=4, units=(4,))
    with pytest.raises(ValueError, match="do not split over 4"):
        shard_copies(layout, [0], [0], Shard(0, 4), Shard(0, 1))
