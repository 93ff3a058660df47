"""The prefill worker: computes prompts and pushes their KV into a decode worker's pool.

Life cycle of a request here (docs/architecture.md §1, steps 3-4; push):
  1. Generate from the tokenizer names the decode worker that will continue it. The
     prompt joins the engine's prefill queue at once (chunked, batched with others), so
     the reservation's round trip hides behind the compute. The request waits in
     `waiting` until the reservations in flight leave room (at most about two steps'
     worth of prompt tokens), then Reserve goes to that decode worker: decode's blocks
     are held only shortly before they are filled.
  2. Reserved: the reservation is checked (sender.Sender.accept). RequestError from
     decode (refused, draining) goes on to the tokenizer and the prompt is dropped.
  3. The step that completes the prompt samples the first token, which goes straight
     to the tokenizer (time to first token waits neither for the reservation nor for
     the copy). If that token ends the request, the reservation is released.
     Otherwise the copy of its blocks starts as soon as both the prompt is done and the
     reservation is there, on the transport's threads (or CUDA stream) while the next
     step computes; until then the prompt's blocks stay held here.
  4. When the copy is done, Migrated (with the first token) goes to decode and the
     prompt's blocks here are freed (the prefix cache keeps them while it can).
  5. Abort at any point: before the copy, the request is dropped and the reservation
     released; during the copy, Release goes out once the copy finished. Failures
     (a bad reservation, a failed copy, a decode worker that died, no reservation in
     time) end the request with a clear RequestError and release what it held. A copy
     that does not finish within the timeout means the transport is broken: the
     process exits and the supervisor restarts it (decode frees its reservations when
     it sees this process gone).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, defaultdict, deque
from typing import Any

from lmd import protocol
from lmd.engine.engine import Engine
from lmd.engine.events import TokenEvent
from lmd.hybrid.worker import EngineWorker, logprobs_dict
from lmd.migration.receiver import MigrationError
from lmd.migration.sender import Outgoing, Sender
from lmd.migration.shards import Shard
from lmd.migration.stats import MigrationStats
from lmd.protocol import Message, Role

log = logging.getLogger(__name__)

# Reserve ahead at most this many steps' worth of prompt tokens.
RESERVE_AHEAD_STEPS = 2
RELEASED_MEMORY = 4096


class PrefillWorker(EngineWorker):
    role = Role.PREFILL
    engine: Engine
    accepted = (protocol.Generate, protocol.Abort, protocol.Reserved, protocol.RequestError)

    async def start(self) -> None:
        await super().start()
        assert self.memory is not None
        self.sender = Sender(
            self.memory.transport,
            self.memory.region,
            self.engine.pool,
            Shard(0, self.spec.tp),  # rank 0 of its group; the other ranks copy their heads
            self.ranks,
        )
        if self.engine.pool.device.type == "cuda":
            import torch

            self.sender.wait_stream = torch.cuda.current_stream(self.engine.pool.device).cuda_stream
        self.timeout_s = self.config.migration_timeout
        self.migration = MigrationStats()
        self._outgoing: OrderedDict[str, Outgoing] = OrderedDict()  # by request id
        self._waiting: deque[Outgoing] = deque()  # no Reserve sent yet, oldest first
        # Requests whose reservation was released before decode answered: their late
        # Reserved is expected, not a stray message (bounded, oldest forgotten first).
        self._released: OrderedDict[str, None] = OrderedDict()
        self._copied: list[Outgoing] = []  # copy finished: free their blocks here

    async def stop(self) -> None:
        self.sender.close()
        await super().stop()

    def stats(self) -> dict[str, Any]:
        copying = sum(1 for o in self._outgoing.values() if o.ticket is not None)
        return {
            **super().stats(),
            "migration": {
                **self.migration.to_dict(),
                "outgoing": len(self._outgoing),
                "copying": copying,
            },
        }

    def inflight(self) -> int:
        return len(self._outgoing)

    # Messages -------------------------------------------------------------------------------

    def apply(self, msg: Message) -> None:
        if isinstance(msg, protocol.Generate):
            self._on_generate(msg)
        elif isinstance(msg, protocol.Reserved):
            self._on_reserved(msg)
        elif isinstance(msg, protocol.RequestError):
            out = self._outgoing.get(msg.request_id)
            if out is not None and not out.reserved:  # decode refused the reservation
                self._drop(out, release=False)
                self.push(out.reply_to, msg)
            else:
                self.count_dropped(f"RequestError for {msg.request_id}")
        elif isinstance(msg, protocol.Abort):
            self._on_abort(msg.request_id)

    def _on_generate(self, msg: protocol.Generate) -> None:
        if not msg.decode:
            self.error(msg.reply_to, msg.request_id, "invalid_request_error", "no decode worker")
            return
        if msg.request_id in self._outgoing:
            self.error(
                msg.reply_to,
                msg.request_id,
                "invalid_request_error",
                f"request id {msg.request_id} is already running",
            )
            return
        seq = self.admit(msg)
        if seq is None:
            return
        try:
            self.engine.add(seq)  # computes while the reservation is on its way
        except ValueError as exc:
            self.error(msg.reply_to, msg.request_id, "invalid_request_error", str(exc))
            return
        out = Outgoing(
            msg.request_id,
            msg.reply_to,
            msg.decode,
            seq,
            msg.sampling,
            time.monotonic(),
            sent_at=msg.sent_at,
        )
        self._outgoing[msg.request_id] = out
        self._waiting.append(out)
        self.clients.note(msg.reply_to, self.workers)

    def _on_reserved(self, msg: protocol.Reserved) -> None:
        out = self._outgoing.get(msg.request_id)
        if out is None and msg.request_id in self._released:
            del self._released[msg.request_id]  # aborted meanwhile; Release already sent
            return
        if out is None or out.reserved or not out.reserve_sent:
            self.count_dropped(f"Reserved for {msg.request_id}")
            self.push(msg.decode, protocol.Release(msg.request_id, self.spec.name))
            return
        self.stages.since("reserve", out.sent_at)
        try:
            self.sender.accept(out, msg)
        except (MigrationError, ValueError) as exc:
            log.warning("%s", exc)
            self.migration.failures += 1
            self._fail(out, "internal_error", f"KV migration refused: {exc}")
            return
        if out.prefilled:  # the prompt was done before the reservation came
            self._start_copy(out)

    def _on_abort(self, request_id: str) -> None:
        out = self._outgoing.get(request_id)
        if out is None:
            return  # already with decode (or unknown): decode takes the abort
        if out.ticket is not None:
            out.aborted = True  # Release once the copy finished
            return
        self._drop(out)

    # Between steps -----------------------------------------------------------------------------

    def between_steps(self) -> None:
        now = time.monotonic()
        for out in self._copied:
            self.engine.block_manager.free(out.seq)
        self._copied = []
        self._send_reserves(now)
        self._expire(now)

    def idle_timeout(self) -> float | None:
        return 1.0 if self._outgoing else None

    def _send_reserves(self, now: float) -> None:
        budget = RESERVE_AHEAD_STEPS * self.engine.config.max_prefill_token_num
        ahead = [o for o in self._outgoing.values() if o.ticket is None and o.reserve_sent]
        tokens = sum(o.seq.num_prompt_tokens for o in ahead)
        limit = self.engine.config.max_batch_size
        while self._waiting and len(ahead) < limit and (not ahead or tokens < budget):
            out = self._waiting.popleft()
            out.reserve_sent = True
            reserve = protocol.Reserve(
                out.request_id,
                self.spec.name,
                out.reply_to,
                out.sampling,
                protocol.pack_ids(out.seq.prompt_token_ids),
            )
            out.since = now
            ahead.append(out)
            tokens += out.seq.num_prompt_tokens
            if not self.push(out.decode, reserve):
                self._fail(out, "service_unavailable", f"{out.decode} is not taking requests")

    def _expire(self, now: float) -> None:
        for out in list(self._outgoing.values()):
            if out.ticket is not None:
                if now - out.copy_started > self.timeout_s:
                    log.critical(
                        "a KV copy to %s has not finished in %.0f s; the transport is broken, "
                        "exiting so that the supervisor restarts this worker",
                        out.decode,
                        self.timeout_s,
                    )
                    self.fail_all("KV migration stalled")
                    os._exit(1)
            elif out.reserve_sent and not out.reserved and now - out.since > self.timeout_s:
                self.migration.failures += 1
                self._fail(
                    out,
                    "service_unavailable",
                    f"{out.decode} reserved no KV blocks within {self.timeout_s:.0f} s",
                )

    def workers_changed(self, workers: dict[str, int]) -> None:
        """Fail the requests bound for decode workers that went away, close their pools
        (and drop the requests of tokenizers that went away: EngineWorker's)."""
        super().workers_changed(workers)
        for out in list(self._outgoing.values()):
            if out.decode in workers or out.aborted:
                continue
            if out.ticket is not None:
                out.aborted = True  # the copy ends harmlessly; the request fails now
            self.migration.failures += int(out.reserved)
            self._fail(out, "service_unavailable", f"decode worker {out.decode} died")
        for name in list(self.sender.peers):
            if name not in workers:
                self.sender.close_peer(name)

    # Step results -------------------------------------------------------------------------------

    def on_events(self, events: list[TokenEvent]) -> None:
        # First tokens go to their tokenizer now: time to first token does not wait for
        # the copy and a hop through decode.
        first_tokens: defaultdict[str, list[TokenEvent]] = defaultdict(list)
        for event in events:
            out = self._outgoing.get(event.request_id)
            if out is None:
                continue
            self.first_token(event.request_id)
            out.first_at = time.monotonic()
            if event.finish_reason is not None:  # the first token ended it: no migration
                self._drop(out)
            else:
                out.first = event  # decode continues from it once the KV is there
            first_tokens[out.reply_to].append(event)
        for reply_to, firsts in first_tokens.items():
            self.send_tokens(reply_to, firsts)
        for seq in self.engine.take_prefilled():
            out = self._outgoing.get(seq.request_id)
            if out is None:  # aborted while the step ran
                self.engine.block_manager.free(seq)
                continue
            out.prefilled = True  # its blocks stay held until they are copied
            if out.reserved:
                self._start_copy(out)

    def _start_copy(self, out: Outgoing) -> None:
        try:
            self.sender.submit(out, time.monotonic())
        except (ValueError, RuntimeError) as exc:
            log.warning("KV copy of %s to %s failed: %s", out.request_id, out.decode, exc)
            self.migration.failures += 1
            self._fail(out, "internal_error", f"KV migration failed: {exc}")
            return
        self.watch(self._finish_copy(out), f"the KV copy of {out.request_id}", may_return=True)

    async def _finish_copy(self, out: Outgoing) -> None:
        assert out.ticket is not None
        ok = False
        error = ""
        try:
            ok = await asyncio.to_thread(out.ticket.wait, self.timeout_s)
        except RuntimeError as exc:
            error = str(exc)
        if not ok and not error:
            return  # timed out: _expire exits the process
        seconds = time.monotonic() - out.copy_started
        first = out.first
        self._copied.append(out)  # its blocks are freed between steps
        self.wake()
        if self._outgoing.pop(out.request_id, None) is None:
            return  # failed meanwhile (its decode worker died)
        if error or first is None:
            self.migration.failures += 1
            log.warning("KV copy of %s to %s failed: %s", out.request_id, out.decode, error)
            self.push(out.decode, protocol.Release(out.request_id, self.spec.name))
            self.error(out.reply_to, out.request_id, "internal_error", "KV migration failed")
            return
        if out.aborted:
            self.push(out.decode, protocol.Release(out.request_id, self.spec.name))
            return
        self.migration.record(out.ticket.nbytes, seconds)
        migrated = protocol.Migrated(
            out.request_id,
            self.spec.name,
            first.token_id,
            logprobs_dict(first),
            first.cached_tokens,
        )
        if not self.push(out.decode, migrated):
            self.migration.failures += 1
            self.error(out.reply_to, out.request_id, "service_unavailable", f"{out.decode} is gone")
            return
        self.stages.observe("migration", time.monotonic() - out.first_at)

    # Helpers ------------------------------------------------------------------------------------

    def _drop(self, out: Outgoing, *, release: bool = True) -> None:
        """Forget a request before its copy started: free its prompt's blocks here and
        release its reservation if any (`release=False`: decode refused it, there is
        nothing to release). A copy in flight frees and releases when it finishes."""
        self._outgoing.pop(out.request_id, None)
        if out.ticket is None:
            if out.prefilled:
                self.engine.block_manager.free(out.seq)
            else:
                self.engine.abort(out.request_id)  # still computing, or finished
        if not out.reserve_sent:
            self._waiting.remove(out)
            return
        if out.ticket is None and release:
            self.push(out.decode, protocol.Release(out.request_id, self.spec.name))
            if not out.reserved:
                self._released[out.request_id] = None
                if len(self._released) > RELEASED_MEMORY:
                    self._released.popitem(last=False)

    def _fail(self, out: Outgoing, code: str, message: str) -> None:
        self._drop(out)
        self.error(out.reply_to, out.request_id, code, message)

    def drop_requests_of(self, receiver: str) -> list[str]:
        """As an Abort of each request answering to `receiver`: a reservation is released,
        a copy in flight finishes first (those already with decode, decode drops)."""
        dropped = [rid for rid, out in self._outgoing.items() if out.reply_to == receiver]
        for request_id in dropped:
            self._on_abort(request_id)
        return dropped

    def fail_requests(self, request_ids: list[str], code: str, message: str) -> None:
        for request_id in request_ids:
            out = self._outgoing.get(request_id)
            if out is not None:
                self._fail(out, code, message)

    def fail_all(self, message: str) -> None:
        for out in self._outgoing.values():
            self.error(out.reply_to, out.request_id, "internal_error", message)
