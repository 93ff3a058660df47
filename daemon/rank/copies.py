"""A prefill rank's part of a migration: its heads of a prompt's blocks, into the decode
group's pools (migration/shards.py says which bytes go where).

Life cycle of a copy op (sent by rank 0's sender with the decode worker's reservation):
  1. `submit(header, descriptors)`: each decode rank whose heads overlap this rank's is
     opened (once per decode worker and descriptor: a restarted decode worker brings new
     ones) and checked to hold the pool the reservation says, then its ranges go to the
     transport, which copies on its own threads (or CUDA stream) while steps go on.
  2. `poll()` returns each op whose copies all finished or one failed, as the reply rank
     0 waits for ({"op": "copied", "id", "ok", "nbytes", "error"}).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmd.migration.base import MigrationTransport, TicketLike
from lmd.migration.shards import BlockLayout, Shard, shard_copies


@dataclass(slots=True)
class _Op:
    op_id: int
    tickets: list[TicketLike] = field(default_factory=list)
    error: str = ""


class Copier:
    def __init__(
        self,
        transport: MigrationTransport,
        region: Any,
        layout: BlockLayout,
        shard: Shard,
        wait_stream: int | None = None,
    ) -> None:
        self.transport = transport
        self.region = region  # this rank's pool, registered
        self.layout = layout
        self.shard = shard
        self.wait_stream = wait_stream
        self._peers: dict[tuple[str, int], tuple[bytes, Any]] = {}  # (decode, rank) -> region
        self._ops: list[_Op] = []

    @property
    def busy(self) -> bool:
        return bool(self._ops)

    def submit(self, header: dict[str, Any], descriptors: Sequence[bytes]) -> None:
        op = _Op(int(header["id"]))
        self._ops.append(op)
        dst_size = len(descriptors)
        try:
            for dst_rank, descriptor in enumerate(descriptors):
                copies = shard_copies(
                    self.layout, header["src"], header["dst"], self.shard, Shard(dst_rank, dst_size)
                )
                if not copies:
                    continue
                peer = self._open(header["decode"], dst_rank, descriptor)
                if peer.size < header["num_blocks"] * self.layout.nbytes(dst_size):
                    raise ValueError(f"rank {dst_rank}'s pool is smaller than reserved")
                op.tickets.append(
                    self.transport.submit(self.region, peer, copies, self.wait_stream)
                )
        except (ValueError, RuntimeError) as exc:
            op.error = str(exc)

    def poll(self) -> list[dict[str, Any]]:
        """The ops that ended since the last call, as their replies."""
        done, left = [], []
        for op in self._ops:
            try:
                finished = bool(op.error) or all(t.poll() for t in op.tickets)
            except RuntimeError as exc:
                op.error, finished = str(exc), True
            if not finished:
                left.append(op)
                continue
            done.append(
                {
                    "op": "copied",
                    "id": op.op_id,
                    "ok": not op.error,
                    "nbytes": sum(t.nbytes for t in op.tickets),
                    "error": op.error,
                }
            )
        self._ops = left
        return done

    def _open(self, decode: str, rank: int, descriptor: bytes) -> Any:
        found = self._peers.get((decode, rank))
        if found is not None and found[0] == descriptor:
            return found[1]
        if found is not None:  # that decode worker restarted: a new pool
            found[1].close()
        region = self.transport.open(descriptor)
        self._peers[(decode, rank)] = (descriptor, region)
        return region

    def close(self) -> None:
        for _, region in self._peers.values():
            region.close()
        self._peers.clear()
