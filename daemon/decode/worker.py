"""The decode worker: reserves KV blocks for prefill, then decodes migrated requests.

Life cycle of a request here (docs/architecture.md §1, steps 3-4; the table is migration.receiver):
  1. Reserve from a prefill worker: queued, then granted when blocks fit (between
     steps, oldest first); Reserved goes back with the block ids and this pool's
     descriptor. A request this worker can never hold gets RequestError (to the
     prefill worker, which passes it to the tokenizer).
  2. Migrated: the KV is in the blocks, and carries the first token, which prefill sent
     to the tokenizer already. The sequence joins the decode batch; from then on it is
     decoded as in a hybrid engine (preempted sequences are recomputed here).
  3. Release frees a reservation prefill gave up. Abort from the tokenizer frees a
     queued or running request; a granted one is freed when its prefill worker is done
     with it (Migrated or Release), since a copy may still be writing into its blocks.
  4. A prefill worker that dies or restarts (ClusterState) loses its reservations here,
     and so does one whose KV does not arrive within the migration timeout: their
     requests end with a RequestError.
Messages that do not fit (unknown request, wrong sender) are logged, counted, dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from lmd import protocol
from lmd.engine.engine import Engine
from lmd.engine.sequence import SamplingParams
from lmd.hybrid.worker import EngineWorker
from lmd.migration.receiver import MigrationError, Receiver, ReservationRefused
from lmd.protocol import Message, Role

log = logging.getLogger(__name__)


class DecodeWorker(EngineWorker):
    role = Role.DECODE
    engine: Engine
    accepted = (protocol.Reserve, protocol.Migrated, protocol.Release, protocol.Abort)

    async def start(self) -> None:
        await super().start()
        assert self.memory is not None
        engine = self.engine
        self.receiver = Receiver(
            engine.block_manager,
            eos_token_ids=engine.backend.eos_token_ids,
            max_seq_len=engine.decode.max_seq_len,
            timeout_s=self.config.migration_timeout,
            vocab_size=engine.backend.vocab_size,
        )
        self.descriptors = [self.memory.descriptor]  # every rank's pool, rank 0 first
        if self.ranks is not None:
            self.descriptors += await asyncio.to_thread(self.ranks.descriptors)
        self.num_migrated = 0
        self.num_refused = 0

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "migration": {
                "received": self.num_migrated,
                "refused": self.num_refused,
                "reserved": self.receiver.num_granted,
                "queued": self.receiver.num_queued,
            },
        }

    def inflight(self) -> int:
        return len(self._reply_to) + len(self.receiver)

    def idle_timeout(self) -> float | None:
        return 1.0 if len(self.receiver) else None

    # Messages -----------------------------------------------------------------------------

    def apply(self, msg: Message) -> None:
        try:
            if isinstance(msg, protocol.Reserve):
                self._on_reserve(msg)
            elif isinstance(msg, protocol.Migrated):
                self._on_migrated(msg)
            elif isinstance(msg, protocol.Release):
                self.receiver.release(msg)
            elif isinstance(msg, protocol.Abort):
                if not self.receiver.abort(msg.request_id):
                    self.engine.abort(msg.request_id)
                self._reply_to.pop(msg.request_id, None)
        except MigrationError as exc:
            self.count_dropped(str(exc))

    def _on_reserve(self, msg: protocol.Reserve) -> None:
        def refuse(code: str, message: str) -> None:
            self.num_refused += 1
            self.push(msg.prefill, protocol.RequestError(msg.request_id, code, message))

        if self.draining:
            refuse("service_unavailable", "the server is draining")
            return
        if msg.request_id in self._reply_to:
            raise MigrationError(f"Reserve of {msg.request_id}: the request is already running")
        try:
            guide = self.new_guide(SamplingParams(**msg.sampling))
            self.receiver.reserve(msg, self.workers.get(msg.prefill), time.monotonic(), guide)
            self.clients.note(msg.reply_to, self.workers)
        except ReservationRefused as exc:
            refuse("invalid_request_error", f"{self.spec.name}: {exc}")
        except MigrationError:
            raise  # a stray message: apply() counts and drops it
        except (TypeError, ValueError) as exc:  # bad sampling parameters
            refuse("invalid_request_error", str(exc))

    def _on_migrated(self, msg: protocol.Migrated) -> None:
        res = self.receiver.get(msg.request_id)
        try:
            seq = self.receiver.migrated(msg)
        except MigrationError:
            if res is not None and self.receiver.get(msg.request_id) is None:
                # a bad first token freed the reservation: the request ends here
                self.error(res.reply_to, msg.request_id, "internal_error", "KV migration failed")
            raise  # apply() counts and drops the message
        if seq is None or res is None:
            return  # aborted while its KV was on the way
        self.num_migrated += 1
        reason = seq.finish_reason
        if reason is None:  # prefill sent the first token to the tokenizer already
            self._reply_to[seq.request_id] = res.reply_to
            self.engine.add_prefilled(seq)
            return
        # Only where this worker's limits differ from prefill's: the first token ends it
        # here; the tokenizer takes this duplicate of token 0 as the finish.
        tokens = protocol.Tokens(
            [seq.request_id],
            [str(reason)],
            [msg.logprobs],
            [msg.cached_tokens],
            protocol.pack_ids([msg.token_id]),
            protocol.pack_ids([0]),
        )
        self.push(res.reply_to, tokens)

    # Between steps ---------------------------------------------------------------------------

    def workers_changed(self, workers: dict[str, int]) -> None:
        """Free the reservations of prefill workers that went away (and drop the requests
        of tokenizers that went away: EngineWorker's)."""
        super().workers_changed(workers)
        for res in self.receiver.prefill_gone(workers):
            self.error(
                res.reply_to,
                res.seq.request_id,
                "service_unavailable",
                f"prefill worker {res.prefill} died before the KV migrated",
            )

    def drop_requests_of(self, receiver: str) -> list[str]:
        """Abort the running requests and the reservations answering to `receiver`."""
        reserved = self.receiver.request_ids_of(receiver)
        for request_id in reserved:
            self.receiver.abort(request_id)
        return super().drop_requests_of(receiver) + reserved

    def between_steps(self) -> None:
        now = time.monotonic()
        for res in self.receiver.expire(now):
            log.warning("%s: no KV from %s in time", res.seq.request_id, res.prefill)
            self.error(
                res.reply_to,
                res.seq.request_id,
                "internal_error",
                f"the KV from {res.prefill} did not arrive within {self.receiver.timeout_s:.0f} s",
            )
        running = self.engine.decode.num_seqs
        pool = self.engine.pool
        for res in self.receiver.grant(running, now):
            seq = res.seq
            reserved = protocol.Reserved(
                seq.request_id,
                self.spec.name,
                self.memory.transport.name if self.memory else "",
                pool.block_nbytes,
                pool.num_blocks,
                seq.num_cached_tokens // pool.block_size,
                [len(d) for d in self.descriptors] if self.ranks is not None else [],
                b"".join(self.descriptors),
                protocol.pack_ids(seq.block_table),
            )
            self.push(res.prefill, reserved)
