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

Tensor parallelism (shards.py): this worker may be rank 0 of a prefill group and the
decode worker a group of another size. Rank 0 copies its heads of the blocks into each
decode rank that holds some of them; with `ranks` (its group) it sends the same
reservation to its other ranks as one copy op, and the request's ticket is done when
every rank's copies are (`GroupTicket`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lmd import protocol
from lmd.engine.events import TokenEvent
from lmd.engine.kv_pool import KVPool
from lmd.engine.sequence import Sequence
from lmd.migration.base import MigrationTransport, TicketLike
from lmd.migration.receiver import MigrationError
from lmd.migration.shards import WHOLE, BlockLayout, Shard, shard_copies
from lmd.migration.tickets import DoneTicket, GroupTicket, RemoteCopies

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
    peers: dict[int, Any] = field(default_factory=dict)  # decode rank -> its pool, opened
    dst_descriptors: list[bytes] = field(default_factory=list)  # every decode rank's
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


class RankCopies(Protocol):
    """This worker's tensor-parallel group (hybrid/rank_group.py), for copy ops."""

    def send(self, header: dict[str, Any], frames: list[bytes]) -> None: ...

    def expect_copy(self, op_id: int, done: Callable[[list[dict[str, Any]]], None]) -> None: ...


class Sender:
    def __init__(
        self,
        transport: MigrationTransport,
        region: Any,
        pool: KVPool,
        shard: Shard = WHOLE,
        ranks: RankCopies | None = None,
    ) -> None:
        self.transport = transport
        self.region = region  # the local pool's region
        self.pool = pool
        self.shard = shard  # this process's place in its group (rank 0)
        self.ranks = ranks  # the group's other ranks, when there are some
        self.layout = BlockLayout.of(pool, shard.size)
        self.wait_stream: int | None = None  # CUDA: the stream that wrote the KV
        self._peers: dict[tuple[str, int], _Peer] = {}  # (decode worker, its rank) -> pool
        self._op_ids = itertools.count()
        self.num_bytes = 0  # copied, since start
        self.num_copies = 0

    @property
    def peers(self) -> list[str]:
        """Decode workers whose pool is open."""
        return list(dict.fromkeys(decode for decode, _ in self._peers))

    def accept(self, out: Outgoing, msg: protocol.Reserved) -> None:
        """Check decode's reservation for `out`; raises MigrationError saying what is wrong."""
        where = f"Reserved {msg.request_id} from {msg.decode}"
        if msg.decode != out.decode:
            raise MigrationError(f"{where}: the request was sent to {out.decode}")
        if msg.transport != self.transport.name:
            raise MigrationError(
                f"{where}: transport {msg.transport!r}, this worker uses {self.transport.name!r}"
            )
        descriptors = msg.descriptors
        size = len(descriptors)
        if not self.layout.splits_over(size):
            raise MigrationError(f"{where}: {self.layout.num_heads} KV heads over {size} ranks")
        if msg.block_nbytes != self.layout.nbytes(size):
            raise MigrationError(
                f"{where}: {msg.block_nbytes} bytes per block, this pool's make "
                f"{self.layout.nbytes(size)} per rank of {size} (model, dtype and block_size "
                "must match)"
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
        peers = {}
        for rank, descriptor in enumerate(descriptors):
            if not shard_copies(self.layout, [0], [0], self.shard, Shard(rank, size)):
                continue  # that decode rank holds none of this rank's heads
            peer = self._open(msg.decode, rank, descriptor)
            if peer.size < msg.num_blocks * msg.block_nbytes:
                raise MigrationError(
                    f"{where}: rank {rank}'s pool is {peer.size} bytes, not {msg.num_blocks} blocks"
                )
            peers[rank] = peer
        out.dst_block_ids = ids
        out.num_cached_blocks = msg.num_cached_blocks
        out.peers = peers
        out.dst_descriptors = descriptors

    def pool_blocks_for(self, seq: Sequence) -> int:
        """Blocks a prompt's KV fills (the first sampled token has none yet)."""
        return -(-seq.num_prompt_tokens // self.pool.block_size)

    def submit(self, out: Outgoing, now: float) -> None:
        """Start copying `out`'s prompt blocks into the reserved ones (this rank's heads
        here, the other ranks' through their copy op)."""
        skip = out.num_cached_blocks
        src = out.seq.block_table[skip : self.pool_blocks_for(out.seq)]
        dst = out.dst_block_ids[skip:]
        out.copy_started = now
        if not src:  # decode caches the whole prompt already
            out.ticket = DoneTicket()
            return
        size = len(out.dst_descriptors)
        tickets = []
        for rank, peer in out.peers.items():
            copies = shard_copies(self.layout, src, dst, self.shard, Shard(rank, size))
            tickets.append(self.transport.submit(self.region, peer, copies, self.wait_stream))
            self.num_copies += len(copies)
        remote = None if self.ranks is None else self._copy_on_ranks(out, src, dst)
        out.ticket = GroupTicket(tickets, remote)

    def _copy_on_ranks(self, out: Outgoing, src: list[int], dst: list[int]) -> RemoteCopies:
        """The other ranks' copies of `out`, as one op to each."""
        assert self.ranks is not None
        remote = RemoteCopies(out.decode)
        op_id = next(self._op_ids)
        self.ranks.expect_copy(op_id, remote.done)
        header = {
            "op": "copy",
            "id": op_id,
            "decode": out.decode,
            "src": src,
            "dst": dst,
            "num_blocks": max(dst) + 1,
            "sizes": [len(d) for d in out.dst_descriptors],
        }
        self.ranks.send(header, [b"".join(out.dst_descriptors)])
        return remote

    def close_peer(self, decode: str) -> None:
        for key in [k for k in self._peers if k[0] == decode]:
            self._peers.pop(key).region.close()

    def close(self) -> None:
        for name in self.peers:
            self.close_peer(name)

    def _open(self, decode: str, rank: int, descriptor: bytes) -> Any:
        peer = self._peers.get((decode, rank))
        if peer is not None and peer.descriptor == descriptor:
            return peer.region
        if peer is not None:  # decode restarted: a new pool
            log.info("%s has a new KV pool; reopening it", decode)
            self.close_peer(decode)
        try:
            region = self.transport.open(descriptor)
        except (ValueError, RuntimeError) as exc:
            raise MigrationError(f"cannot open {decode}'s KV pool: {exc}") from None
        self._peers[(decode, rank)] = _Peer(descriptor, region)
        return region
