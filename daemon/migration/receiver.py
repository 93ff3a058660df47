"""The decode side of a migration: KV reservations. Pure: no I/O, no tensors.

Life cycle of a reservation (docs/architecture.md §1, steps 3-4; push, decode-first):
  1. `reserve(msg)`: prefill asks for blocks for a prompt. A request that can never fit
     (prompt over this engine's length limit, more blocks than the whole pool) raises
     ReservationRefused with the reason; otherwise it queues (FIFO).
  2. `grant()` allocates blocks to queued requests in order while they fit, leaving a
     block of headroom per running sequence (back-pressure: no blocks, no reservation,
     no prefill). Each granted one is answered with Reserved by the worker.
  3. `migrated(msg)`: the KV is in the blocks; the first token is appended and the
     sequence is handed back for the decode batch (or, if that token finished it, freed).
  4. `release(msg)`: prefill will not send KV (finished at its first token, aborted,
     failed): the blocks are freed.
  5. `abort(request_id)` (the client went away): a queued request is dropped; a granted
     one keeps its blocks until its prefill sends Migrated or Release, because a copy
     may still be writing into them, then they are freed and nothing is emitted.
  6. `prefill_gone(workers)` frees every reservation whose prefill process is no longer
     the one that asked (died or restarted): no copy can still land. `expire(now)` frees
     granted reservations older than the timeout (a prefill that lost track).
Messages about requests this table does not hold, or from a prefill that does not own
them, raise MigrationError: the worker logs, counts and drops them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from lmd import protocol
from lmd.engine.block_manager import BlockManager
from lmd.engine.grammar import Guide
from lmd.engine.sequence import FinishReason, SamplingParams, Sequence, check_token_ids

ABORTED_MEMORY = 4096


class MigrationError(ValueError):
    """A migration message that does not fit the state: dropped and counted."""


class ReservationRefused(ValueError):
    """This decode worker can never take the request; the message says why."""


@dataclass(slots=True, eq=False)
class Reservation:
    seq: Sequence
    prefill: str
    prefill_pid: int | None  # the prefill process that asked (None: not known yet)
    reply_to: str
    since: float  # when it was queued, then when it was granted
    granted: bool = False
    aborted: bool = False  # the client went away; free once prefill is done with it


class Receiver:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        eos_token_ids: Iterable[int],
        max_seq_len: int,
        timeout_s: float,
        vocab_size: int,
    ) -> None:
        self.block_manager = block_manager
        self.eos_token_ids: Collection[int] = frozenset(eos_token_ids)
        self.vocab_size = vocab_size  # token ids from a peer must index the model's
        self.max_seq_len = max_seq_len
        self.timeout_s = timeout_s
        self._queue: deque[Reservation] = deque()
        self._by_id: dict[str, Reservation] = {}
        # Queued reservations an Abort freed, by request id -> prefill worker: their
        # prefill's Release is on its way and expected (bounded, oldest forgotten first).
        self._aborted: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_granted(self) -> int:
        return len(self._by_id) - len(self._queue)

    def get(self, request_id: str) -> Reservation | None:
        return self._by_id.get(request_id)

    def request_ids_of(self, reply_to: str) -> list[str]:
        """The reservations whose tokens go to `reply_to` (not aborted yet)."""
        return [r for r, res in self._by_id.items() if res.reply_to == reply_to and not res.aborted]

    def reserve(
        self, msg: protocol.Reserve, prefill_pid: int | None, now: float, guide: Guide | None = None
    ) -> None:
        """Queue a reservation; raises ReservationRefused or ValueError (bad request:
        sampling settings, a token id outside the vocabulary). `guide`: the sequence's
        place in its grammar (structured output), which takes the first token too."""
        if msg.request_id in self._by_id:
            raise MigrationError(f"request {msg.request_id} is already reserved")
        seq = Sequence(msg.request_id, msg.prompt_token_ids, SamplingParams(**msg.sampling))
        seq.guide = guide
        check_token_ids(seq, self.vocab_size)
        if seq.num_tokens >= self.max_seq_len:
            raise ReservationRefused(
                f"the prompt has {seq.num_tokens} tokens; this decode worker holds at most "
                f"{self.max_seq_len - 1} prompt tokens (session_len and KV pool size)"
            )
        needed = self.block_manager.num_blocks_needed(seq.num_tokens + 1)
        if needed > self.block_manager.num_total_blocks:
            raise ReservationRefused(
                f"the prompt needs {needed} KV blocks; the decode pool has "
                f"{self.block_manager.num_total_blocks}"
            )
        res = Reservation(seq, msg.prefill, prefill_pid, msg.reply_to, now)
        self._queue.append(res)
        self._by_id[msg.request_id] = res

    def grant(self, num_running: int, now: float) -> list[Reservation]:
        """Allocate blocks to queued reservations in order while they fit."""
        granted: list[Reservation] = []
        while self._queue:
            res = self._queue[0]
            headroom = num_running + len(granted)
            if not self._fits(res.seq, headroom):
                break
            self._queue.popleft()
            self.block_manager.allocate(res.seq)
            res.granted, res.since = True, now
            granted.append(res)
        return granted

    def _fits(self, seq: Sequence, headroom: int) -> bool:
        if not self.block_manager.can_allocate(seq):
            return False
        # Leave running sequences room to grow, unless nothing else holds blocks.
        needed = self.block_manager.num_blocks_needed(seq.num_tokens)
        busy = headroom > 0 or self.num_granted > 0
        return not busy or needed + headroom <= self.block_manager.num_free_blocks

    def migrated(self, msg: protocol.Migrated) -> Sequence | None:
        """The KV arrived: the sequence to decode (None if it was aborted or finished).

        A finished sequence (its first token ended it) is freed and returned with its
        finish reason, for the worker to emit that token.
        """
        res = self._take_granted(msg.request_id, msg.prefill, "Migrated")
        seq = res.seq
        if res.aborted:
            self.block_manager.free(seq)
            return None
        if not 0 <= msg.token_id < self.vocab_size:
            self.block_manager.free(seq)
            raise MigrationError(
                f"Migrated {msg.request_id}: token id {msg.token_id} is outside the "
                f"vocabulary (0-{self.vocab_size - 1})"
            )
        if not 0 <= msg.cached_tokens <= seq.num_prompt_tokens:
            self.block_manager.free(seq)
            raise MigrationError(
                f"Migrated {msg.request_id}: {msg.cached_tokens} cached tokens of a "
                f"{seq.num_prompt_tokens}-token prompt"
            )
        seq.num_cached_tokens = seq.num_tokens
        self.block_manager.cache_full_blocks(seq)
        reason = seq.append_token(
            msg.token_id, eos_token_ids=self.eos_token_ids, max_seq_len=self.max_seq_len
        )
        if reason is not None:
            self.block_manager.free(seq)
        return seq

    def release(self, msg: protocol.Release) -> Reservation | None:
        """Free a reservation its prefill gave up (queued or granted); None when an
        Abort freed it first."""
        if self._aborted.get(msg.request_id) == msg.prefill:
            del self._aborted[msg.request_id]
            return None
        res = self._by_id.get(msg.request_id)
        if res is None or res.prefill != msg.prefill:
            raise MigrationError(
                f"Release of {msg.request_id} from {msg.prefill}: no such reservation"
            )
        self._forget(res)
        return res

    def abort(self, request_id: str) -> bool:
        """The client went away; True if this table held the request."""
        res = self._by_id.get(request_id)
        if res is None:
            return False
        if res.granted:
            res.aborted = True  # freed when its prefill sends Migrated or Release
        else:
            self._forget(res)
            self._aborted[request_id] = res.prefill
            if len(self._aborted) > ABORTED_MEMORY:
                self._aborted.popitem(last=False)
        res.seq.finish(FinishReason.ABORT)
        return True

    def prefill_gone(self, workers: dict[str, int]) -> list[Reservation]:
        """Free reservations of prefill processes no longer running (by name and pid)."""
        gone = []
        for res in list(self._by_id.values()):
            pid = workers.get(res.prefill)
            if res.prefill_pid is None and pid is not None:
                res.prefill_pid = pid
            elif pid is None or pid != res.prefill_pid:
                self._forget(res)
                gone.append(res)
        return gone

    def expire(self, now: float) -> list[Reservation]:
        """Free granted reservations whose KV did not come within the timeout."""
        old = [r for r in self._by_id.values() if r.granted and now - r.since > self.timeout_s]
        for res in old:
            self._forget(res)
        return old

    def _take_granted(self, request_id: str, prefill: str, what: str) -> Reservation:
        res = self._by_id.get(request_id)
        if res is None or res.prefill != prefill or not res.granted:
            raise MigrationError(f"{what} of {request_id} from {prefill}: no granted reservation")
        del self._by_id[request_id]
        return res

    def _forget(self, res: Reservation) -> None:
        del self._by_id[res.seq.request_id]
        if res.granted:
            self.block_manager.free(res.seq)
        else:
            self._queue.remove(res)
