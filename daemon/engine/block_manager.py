"""Paged KV bookkeeping: which pool blocks each sequence holds, and the prefix cache.

Lifecycle of a block:
  free       --allocate/append-->   used (ref_count >= 1, owned by sequences)
  used       --cache_full_blocks--> used and hashed: full, KV computed, shareable
  used       --free, last ref-->    free if unhashed, else evictable (still cached)
  evictable  --prefix hit-->        used again (its KV is reused, not recomputed)
  evictable  --allocate needs it--> free (hash dropped, least recently freed first)

With a sliding window on every layer (`window` > 0), the blocks of a decoding sequence
that no later query can see (all their tokens `window` or more positions behind the
next one) are released as it goes (`release_behind_window`); its block table keeps
their places, pointing at block 0, which nothing reads there.

Free and evictable blocks both count as free: once every sequence is freed,
num_free_blocks == num_total_blocks. A block's hash is a chain: blake2b of the previous
block's hash and this block's token ids, so a hit on block i implies the whole prefix
up to i matches. Only full blocks whose KV has been computed are hashed, and a prompt
never hits its own last token (its logits must be computed).
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from lmd.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    digest: bytes | None = None  # hash chain of a full, computed block


def block_digest(parent: bytes | None, token_ids: SequenceOf[int]) -> bytes:
    """Hash of one full block, chained on the hash of the block before it."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    """Reference-counted allocator over `num_blocks` KV blocks of `block_size` tokens."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = False,
        window: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # every layer's sliding window, or 0
        self._blocks = [Block(i) for i in range(num_blocks)]
        # Lowest id first, so a fresh pool hands out contiguous runs (cheap migration).
        self._free: list[int] = list(range(num_blocks))
        # Unreferenced but still cached blocks, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}  # digest -> block id holding that KV
        self._num_hashed: dict[str, int] = {}  # request id -> leading blocks hashed
        self._num_released: dict[str, int] = {}  # request id -> leading blocks behind the window

    # -- counters ---------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-used plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache can serve (referenced or evictable)."""
        return len(self._cached)

    @property
    def max_num_tokens(self) -> int:
        """The most tokens one sequence can ever hold in this pool."""
        return self.num_total_blocks * self.block_size

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    # -- allocate / free ----------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether blocks for all of `seq`'s tokens fit now, counting prefix hits."""
        hits = self._match_prefix(seq)
        revived = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        num_new = self.num_blocks_needed(seq.num_tokens) - len(hits)
        return num_new + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks.

        Sets seq.num_cached_tokens to the tokens served by the prefix cache: those
        need no compute.
        """
        if seq.block_table:
            raise RuntimeError(f"request {seq.request_id} already holds blocks; free it first")
        if not self.can_allocate(seq):
            raise RuntimeError(
                f"request {seq.request_id} needs more blocks than are free; "
                "check can_allocate first"
            )
        hits = self._match_prefix(seq)
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
        num_new = self.num_blocks_needed(seq.num_tokens) - len(hits)
        seq.block_table = hits + [self._take_free() for _ in range(num_new)]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_prefix_cached_tokens = seq.num_cached_tokens
        if self.enable_prefix_caching:
            self._num_hashed[seq.request_id] = len(hits)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; safe to call again (a no-op once freed)."""
        # Tail first: the tail of a sequence is evicted before its shared prefix.
        released = self._num_released.pop(seq.request_id, 0)
        for block_id in reversed(seq.block_table[released:]):
            self._release(block_id)
        seq.block_table = []
        seq.num_cached_tokens = 0
        self._num_hashed.pop(seq.request_id, None)

    def release_behind_window(self, seq: Sequence) -> int:
        """Release `seq`'s leading blocks no query from its next token on can see; returns
        how many it released now. Every key j of a block is out of sight once j <= q0 -
        window for the next query position q0 (= num_cached_tokens). With prefix caching
        the last hashed block stays (it chains the next block's hash). A no-op without a
        window."""
        if not self.window:
            return 0
        dead = max(0, (seq.num_cached_tokens - self.window + 1) // self.block_size)
        if self.enable_prefix_caching:
            dead = min(dead, self._num_hashed.get(seq.request_id, 0) - 1)
        done = self._num_released.get(seq.request_id, 0)
        if dead <= done:
            return 0
        for i in range(done, dead):
            self._release(seq.block_table[i])
            seq.block_table[i] = 0  # a placeholder: the kernels start at the window
        self._num_released[seq.request_id] = dead
        return dead - done

    # -- grow -------------------------------------------------------------------------

    def num_missing(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Blocks `seq` lacks to hold `num_tokens` tokens (default: all it has)."""
        needed = self.num_blocks_needed(seq.num_tokens if num_tokens is None else num_tokens)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Whether `seq` can get room for `num_tokens` tokens (default: all it has)."""
        return self.num_missing(seq, num_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Make room for the token just appended to `seq` (a new block when full), or for
        `num_tokens` tokens in all (a step run ahead of its last token's arrival)."""
        if not seq.block_table:
            raise RuntimeError(f"request {seq.request_id} holds no blocks; allocate it first")
        missing = self.num_missing(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(
                f"request {seq.request_id} cannot grow: no free block; check can_append first"
            )
        for _ in range(missing):
            seq.block_table.append(self._take_free())

    # -- prefix cache -----------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish `seq`'s full blocks whose KV is computed, for later prefix hits.

        Call after a step advanced seq.num_cached_tokens. A no-op when prefix caching
        is off. When another block already caches the same tokens, that one stays the
        cached copy and this one is freed normally.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_cached_tokens // self.block_size, len(seq.block_table))
        start = self._num_hashed.get(seq.request_id, 0)
        if num_full <= start:
            return
        tokens = seq.token_ids
        parent = self._blocks[seq.block_table[start - 1]].digest if start else None
        for i in range(start, num_full):
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            digest = block_digest(parent, chunk)
            block = self._blocks[seq.block_table[i]]
            block.digest = digest
            self._cached.setdefault(digest, block.block_id)
            parent = digest
        self._num_hashed[seq.request_id] = num_full

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s leading full blocks, stopping at a miss."""
        if not self.enable_prefix_caching or not self._cached:
            return []
        tokens = seq.token_ids
        # Full blocks strictly before the last token: that one is always computed.
        num_candidates = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        parent: bytes | None = None
        for i in range(num_candidates):
            digest = block_digest(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._cached.get(digest)
            if block_id is None:
                break
            hits.append(block_id)
            parent = digest
        return hits

    # -- internals --------------------------------------------------------------------

    def _take_free(self) -> int:
        if self._free:
            block_id = heapq.heappop(self._free)
        else:
            block_id, _ = self._evictable.popitem(last=False)
            evicted = self._blocks[block_id]
            if evicted.digest is not None:
                del self._cached[evicted.digest]
                evicted.digest = None
        self._blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed twice; the block table is corrupt")
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.digest is not None and self._cached.get(block.digest) == block_id:
            self._evictable[block_id] = None
        else:
            block.digest = None
            heapq.heappush(self._free, block_id)
