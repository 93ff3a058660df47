"""The prefill side of a migration: check a reservation, copy the blocks, track tickets.

Life cycle of an outgoing request (docs/architecture.md §1, steps 3-4):
  1. the worker sends Reserve to the request's decode worker and waits;
  2. `accept(reserved, seq)` checks decode's answer against this pool and the request
     before anything is computed: the transport and block size match, the peer pool
     opens from its descriptor and is as large as it says, there is exactly one block
     id per prompt block, each in range and none twice (a bad or hostile Reserved can
     never make a copy land outside the reserved blocks); raises MigrationError;
  3. once the prompt is computed, `submit(out)` copies the prompt's blocks (less those
     decode already caches) into the reserved ones: runs of consecutive ids go as one
     range, on the transport's own threads or stream, while the next step computes;
  4. `poll()` returns the requests whose copy finished or failed; the worker then
     sends Migrated (or Release) and frees the source blocks.
A peer pool is opened once per decode worker and descriptor; a decode worker that
restarts sends a new descriptor and the old mapping is closed (`close_peer`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from lmd import protocol
from lmd.engine.engine import TokenEvent
from lmd.engine.kv_pool import KVPool
from lmd.engine.sequence import Sequence
from lmd.migration.base import MigrationTransport, TicketLike
from lmd.migration.native import block_copies
from lmd.migration.receiver import MigrationError

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Outgoing:
    """One request on its way from this prefill worker to a decode worker."""

    request_id: str
    reply_to: str
    decode: str
    seq: Sequence
    sampling: dict[str, Any]  # as the tokenizer sent it; passed on in Reserve
    since: float  # when it arrived, then when Reserve went out
    reserve_sent: bool = False
    dst_block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    peer: Any = None  # the decode pool, opened
    first: TokenEvent | None = None  # the first sampled token, sent on in Migrated
    prefilled: bool = False  # the prompt is computed; its blocks wait for the copy
    ticket: TicketLike | None = None
    copy_started: float = 0.0
    aborted: bool = False
    sent_at: float = 0.0  # the Generate's stamp (stage_times.py: reserve)
    first_at: float = 0.0  # time.monotonic() when its first token was sampled (migration)

    @property
    def reserved(self) -> bool:
        return bool(self.dst_block_ids)


@dataclass(slots=True)
class _Peer:
    descriptor: bytes
    region: Any


class Sender:
    def __init__(self, transport: MigrationTransport, region: Any, pool: KVPool) -> None:
        self.transport = transport
        self.region = region  # the local pool's region
        self.pool = pool
        self.wait_stream: int | None = None  # CUDA: the stream that wrote the KV
        self._peers: dict[str, _Peer] = {}
        self.num_bytes = 0  # copied, since start
        self.num_copies = 0

    @property
    def peers(self) -> list[str]:
        """Decode workers whose pool is open."""
        return list(self._peers)

    def accept(self, out: Outgoing, msg: protocol.Reserved) -> None:
        """Check decode's reservation for `out`; raises MigrationError saying what is wrong."""
        where = f"Reserved {msg.request_id} from {msg.decode}"
        if msg.decode != out.decode:
            raise MigrationError(f"{where}: the request was sent to {out.decode}")
        if msg.transport != self.transport.name:
            raise MigrationError(
                f"{where}: transport {msg.transport!r}, this worker uses {self.transport.name!r}"
            )
        if msg.block_nbytes != self.pool.block_nbytes:
            raise MigrationError(
                f"{where}: {msg.block_nbytes} bytes per block, this pool has "
                f"{self.pool.block_nbytes} (model, dtype and block_size must match)"
            )
        ids = msg.dst_block_ids
        expected = self.pool_blocks_for(out.seq)
        if len(ids) != expected:
            raise MigrationError(f"{where}: {len(ids)} block ids for a {expected}-block prompt")
        if not 0 <= msg.num_cached_blocks <= len(ids):
            raise MigrationError(f"{where}: num_cached_blocks {msg.num_cached_blocks} out of range")
        if not 1 <= msg.num_blocks <= 1 << 31:
            raise MigrationError(f"{where}: num_blocks {msg.num_blocks} out of range")
        bad = next((b for b in ids if not 0 <= b < msg.num_blocks), None)
        if bad is not None:
            raise MigrationError(f"{where}: block id {bad} outside 0..{msg.num_blocks - 1}")
        if len(set(ids)) != len(ids):
            raise MigrationError(f"{where}: a block id appears twice")
        peer = self._open(msg.decode, msg.descriptor)
        if peer.size < msg.num_blocks * msg.block_nbytes:
            raise MigrationError(
                f"{where}: the pool is {peer.size} bytes, not {msg.num_blocks} blocks"
            )
        out.dst_block_ids = ids
        out.num_cached_blocks = msg.num_cached_blocks
        out.peer = peer

    def pool_blocks_for(self, seq: Sequence) -> int:
        """Blocks a prompt's KV fills (the first sampled token has none yet)."""
        return -(-seq.num_prompt_tokens // self.pool.block_size)

    def submit(self, out: Outgoing, now: float) -> None:
        """Start copying `out`'s prompt blocks into the reserved ones."""
        skip = out.num_cached_blocks
        src = out.seq.block_table[skip : self.pool_blocks_for(out.seq)]
        dst = out.dst_block_ids[skip:]
        copies = block_copies(src, dst, self.pool.block_nbytes)
        out.copy_started = now
        if not copies:  # decode caches the whole prompt already
            out.ticket = _DoneTicket()
            return
        out.ticket = self.transport.submit(self.region, out.peer, copies, self.wait_stream)
        self.num_copies += len(copies)

    def close_peer(self, decode: str) -> None:
        peer = self._peers.pop(decode, None)
        if peer is not None:
            peer.region.close()

    def close(self) -> None:
        for name in list(self._peers):
            self.close_peer(name)

    def _open(self, decode: str, descriptor: bytes) -> Any:
        peer = self._peers.get(decode)
        if peer is not None and peer.descriptor == descriptor:
            return peer.region
        if peer is not None:  # decode restarted: a new pool
            log.info("%s has a new KV pool; reopening it", decode)
            self.close_peer(decode)
        try:
            region = self.transport.open(descriptor)
        except (ValueError, RuntimeError) as exc:
            raise MigrationError(f"cannot open {decode}'s KV pool: {exc}") from None
        self._peers[decode] = _Peer(descriptor, region)
        return region


class _DoneTicket:
    nbytes = 0

    def poll(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        return True
