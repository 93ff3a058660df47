"""Which bytes of a KV block each rank of a tensor-parallel group holds, and the copies
that move a prompt's KV between groups of equal or of different size.

A block is laid out [L, 2, S, H, D] (then, in a quantized pool, its scales [L, 2, S, H]:
engine/kv_layout.py); a rank of a group of N holds heads [r H/N, (r + 1) H/N) of it, in
the same layout with H/N heads. So the heads are the innermost dimension but one: between
groups of the same size rank r copies whole blocks to rank r (block_copies: runs of
consecutive blocks as one range); between groups of different sizes a source rank copies
to each destination rank whose heads overlap its own one range per (layer, k|v, slot)
row and part (values, scales), the overlap's heads long, and adjacent ranges merge.
Pure: numbers only (sender.py submits them, lmd.rank's copier for the other ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmd.engine.kv_layout import KV_SCALE_DTYPE, QUANT_KV_DTYPES
from lmd.engine.kv_pool import KVPool
from lmd.migration.base import Copy
from lmd.migration.native import block_copies


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of a group of `size` (size 1: the whole model)."""

    rank: int = 0
    size: int = 1

    def heads(self, num_heads: int) -> tuple[int, int]:
        per = num_heads // self.size
        return self.rank * per, (self.rank + 1) * per


WHOLE = Shard()


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """One block of the whole model's pool (every KV head): its rows of L x 2 x S vectors
    per part, each part a unit of bytes per head per row (values: D x element; a
    quantized pool's scales: 2)."""

    num_heads: int  # the whole model's KV heads
    rows: int  # L * 2 * S
    units: tuple[int, ...]  # bytes per head per row of each part, in block order

    def nbytes(self, size: int = 1) -> int:
        """A block's bytes on each rank of a group of `size`."""
        return self.rows * (self.num_heads // size) * sum(self.units)

    def splits_over(self, size: int) -> bool:
        return self.num_heads % size == 0

    @classmethod
    def of(cls, pool: KVPool, group_size: int = 1) -> BlockLayout:
        """The layout of a pool with every rank's heads together, from one rank's `pool`
        of a group of `group_size`."""
        _, num_layers, _, block_size, heads, head_dim = pool.kv.shape
        rows = num_layers * 2 * block_size
        if pool.kv_cache_dtype == "auto":
            return cls(heads * group_size, rows, (head_dim * pool.dtype.itemsize,))
        code = QUANT_KV_DTYPES[pool.kv_cache_dtype].itemsize
        return cls(heads * group_size, rows, (head_dim * code, KV_SCALE_DTYPE.itemsize))


def shard_copies(
    layout: BlockLayout,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    src: Shard,
    dst: Shard,
) -> list[Copy]:
    """The copies moving blocks src_ids[i] of rank `src`'s pool into dst_ids[i] of rank
    `dst`'s (offsets within each pool); [] when the two hold no head in common."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if not (layout.splits_over(src.size) and layout.splits_over(dst.size)):
        raise ValueError(f"{layout.num_heads} KV heads do not split over {src.size} and {dst.size}")
    if src.size == dst.size:
        if src.rank != dst.rank:
            return []
        return block_copies(src_ids, dst_ids, layout.nbytes(src.size))
    src_lo, src_hi = src.heads(layout.num_heads)
    dst_lo, dst_hi = dst.heads(layout.num_heads)
    lo, hi = max(src_lo, dst_lo), min(src_hi, dst_hi)
    if lo >= hi or not src_ids:
        return []
    src_heads, dst_heads = src_hi - src_lo, dst_hi - dst_lo
    src_block, dst_block = layout.nbytes(src.size), layout.nbytes(dst.size)
    rows = np.arange(layout.rows, dtype=np.int64)
    src_parts, dst_parts, lengths = [], [], []  # per part, each row's range in a block
    src_base = dst_base = 0
    for unit in layout.units:
        src_parts.append(src_base + rows * src_heads * unit + (lo - src_lo) * unit)
        dst_parts.append(dst_base + rows * dst_heads * unit + (lo - dst_lo) * unit)
        lengths.append(np.full(layout.rows, (hi - lo) * unit, dtype=np.int64))
        src_base += layout.rows * src_heads * unit
        dst_base += layout.rows * dst_heads * unit
    src_part, dst_part, length_part = map(np.concatenate, (src_parts, dst_parts, lengths))
    src_blocks = np.asarray(src_ids, dtype=np.int64)[:, None] * src_block
    dst_blocks = np.asarray(dst_ids, dtype=np.int64)[:, None] * dst_block
    src_off = (src_blocks + src_part[None]).ravel()
    dst_off = (dst_blocks + dst_part[None]).ravel()
    length = np.broadcast_to(length_part[None], (len(src_ids), length_part.size)).ravel()
    return _merged(src_off, dst_off, length)


def _merged(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> list[Copy]:
    """Ranges in order, each that starts where the one before ends on both sides joined."""
    if src.size == 0:
        return []
    joins = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    totals = np.add.reduceat(length, starts)
    return list(zip(src[starts].tolist(), dst[starts].tolist(), totals.tolist(), strict=True))
