"""Engine workers: one Engine in a process, driven by messages on its inbox.

`EngineWorker` is what every engine role shares; it is also the `hybrid` role, which
runs prefill and decode in one process. lmd.prefill.worker and lmd.decode.worker add
the migration halves (docs/architecture.md §1).

Life cycle of a request in an engine worker:
  1. Data messages (Generate, Abort, and the migration messages of the disaggregated
     roles) are queued as they arrive and applied between two engine steps, in arrival
     order, by `apply(msg)`: the engine's state only ever changes between steps. A bad
     request answers RequestError to its `reply_to`.
  2. `Engine.step` runs in a dedicated thread, so heartbeats and the inbox keep flowing
     while the model computes; `on_events` sends the tokens it sampled, one Tokens
     message per receiver. A request's last token carries its finish reason.
  3. `between_steps()` lets a role do its periodic work (grant reservations, start
     copies, expire timeouts); `idle_timeout()` says how long the loop may sleep when
     the engine has nothing to compute.
  4. If a step raises, every request in flight gets RequestError(internal_error) and the
     process exits 1: the supervisor restarts it with a fresh engine.
  5. A ClusterState that shows a request's receiver (its tokenizer) gone or replaced
     drops the request between steps, freeing its blocks (clients.py): nobody would
     read its tokens.
Sends never wait: a receiver that is gone or not reading loses its tokens (counted).
Everything that arrives over IPC is checked before the engine sees it: sampling settings
(SamplingParams), token ids against the vocabulary and the prompt against the length
limit (Engine.add); a bad request gets RequestError(invalid_request_error) alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import defaultdict
from typing import Any

from lmd import protocol
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.events import TokenEvent
from lmd.engine.fixed_engine import FixedTokenEngine
from lmd.engine.grammar import Guide, check_guided
from lmd.engine.group_backend import GroupBackend
from lmd.engine.memory_plan import StepOutOfMemory, describe
from lmd.engine.sequence import SamplingParams, Sequence
from lmd.hybrid.clients import Clients
from lmd.hybrid.loading import load
from lmd.hybrid.rank_group import RankGroup
from lmd.hybrid.step_thread import StepThread
from lmd.protocol import Message, Role
from lmd.roles import gpu_name
from lmd.stage_times import StageClock
from lmd.worker import Worker

log = logging.getLogger(__name__)

FAIL_FLUSH_S = 0.2  # a failing worker's last wait, for its errors to leave


class EngineWorker(Worker):
    role = Role.HYBRID
    engine: Engine | FixedTokenEngine  # the disaggregated roles run an Engine

    async def start(self) -> None:
        self._compiling: dict[str, list[Message]] = {}  # a request's messages held meanwhile
        # Every torch call of the engine, its build included, on one thread (step_thread.py).
        self._step_thread = StepThread(f"{self.spec.name}-step")
        self.loaded = loaded = await load(self.spec, self.config, self.role, self._step_thread)
        self.engine, self.memory, self.ranks = loaded.engine, loaded.memory, loaded.ranks
        self.grammars = loaded.grammars  # structured output (the fixed engine has none)
        self._reply_to: dict[str, str] = {}  # request id -> receiving worker
        self.clients = Clients()  # the receivers' processes, to drop requests of dead ones
        self._new_workers: dict[str, int] | None = None  # from ClusterState, for between steps
        self._pending: list[Message] = []
        self.clock = StageClock(self.stages)  # a request's queue and prefill stages
        self._step_span = (0.0, 0.0)  # the last step's start and end, time.time()
        self._wake = asyncio.Event()
        self._loop_task = self.watch(self._step_loop(), "the engine step loop")
        if self.ranks is not None:
            self.watch(self._watch_group(self.ranks), "the tensor-parallel group")

    async def _watch_group(self, ranks: RankGroup) -> None:
        """When a rank is gone: fail the requests, saying which rank, and exit at once
        (the other ranks die with this process; the supervisor restarts the worker and
        it starts a new group). As a failed step, not a clean stop: the step thread may
        be waiting in a collective that will never complete."""
        broke, loop = asyncio.Event(), asyncio.get_running_loop()

        def on_death(_reason: str) -> None:  # in the group's reader thread
            loop.call_soon_threadsafe(broke.set)

        ranks.on_death = on_death
        if ranks.dead is None:
            await broke.wait()
        log.error("%s: %s; failing %d requests", self.spec.name, ranks.dead, self.inflight())
        self.fail_all(f"the engine failed: {ranks.dead}")
        await asyncio.sleep(FAIL_FLUSH_S)  # the errors out of the peers' backlogs
        os._exit(1)

    def engine_config(self) -> EngineConfig:
        return self.config.engine_on(self.spec.device)

    async def stop(self) -> None:
        self._loop_task.cancel()
        self._step_thread.shutdown(wait=True, cancel_futures=True)
        await self.loaded.close()

    def info(self) -> dict[str, Any]:
        b = self.engine.backend
        info: dict[str, Any] = {
            "backend": b.local.name if isinstance(b, GroupBackend) else b.name,
            "device": str(b.device),
            "dtype": str(b.dtype)[6:],
            "quantization": b.quantization,
            "kv_cache_dtype": b.kv_cache_dtype,
        }
        if isinstance(self.engine, Engine) and self.engine.memory is not None:
            info["memory"] = self.engine.memory
            if self.ranks is not None:  # every rank's GPU: the plan spans the group's
                info["rank_memory"] = [
                    {**self.engine.memory, **rank} for rank in self.ranks.memory()
                ]
        if self.memory is not None:
            info["transport"] = self.memory.transport.name
        if self.ranks is not None:
            info["tp"] = self.spec.tp
            rank0 = gpu_name(str(b.device)) or str(b.device)  # cuda:0, as ranks name theirs
            info["ranks"] = [{"rank": 0, "pid": os.getpid(), "device": rank0}]
            info["ranks"] += self.ranks.ranks()
        return info

    def stats(self) -> dict[str, Any]:
        stats = {**self.engine.stats(), "num_steps": self.engine.num_steps}
        if self.ranks is not None:  # ranks 1..N-1's memory (status lists them)
            stats["rank_rss_bytes"] = self.ranks.rss()
        return stats

    def inflight(self) -> int:
        return len(self._reply_to)

    def on_cluster_state(self) -> None:
        self._new_workers = dict(self.workers)
        self.wake()  # act on it between steps

    async def handle(self, msg: Message) -> bool:
        if not isinstance(msg, self.accepted):
            return False
        if isinstance(msg, protocol.Generate):
            self.clock.start(msg.request_id, msg.sent_at)
        request_id = getattr(msg, "request_id", "")
        if (held := self._compiling.get(request_id)) is not None:
            held.append(msg)  # behind its request's grammar, in order
            return True
        if (guided := self._grammar_of(msg)) is not None:
            self._compiling[request_id] = [msg]
            self.watch(
                self._compile(request_id, guided), "a grammar's compilation", may_return=True
            )
            return True
        self._pending.append(msg)
        self._wake.set()
        return True

    def _grammar_of(self, msg: Message) -> tuple[str, str] | None:
        """The grammar a request brings (Generate, Reserve) that is to compile first."""
        sampling = getattr(msg, "sampling", None)
        if self.grammars is None or not isinstance(sampling, dict):
            return None
        try:
            return check_guided(sampling.get("guided"))
        except ValueError:
            return None  # admitting it answers why

    async def _compile(self, request_id: str, guided: tuple[str, str]) -> None:
        """Compile off the step loop; then the request's messages go on, in order."""
        assert self.grammars is not None
        try:
            await self.grammars.prepare(guided)
        finally:
            self._pending.extend(self._compiling.pop(request_id))
            self._wake.set()

    def new_guide(self, sampling: SamplingParams) -> Guide | None:
        """The sequence's Guide when it asks for a grammar; GrammarError for a bad one."""
        if sampling.guided is None or self.grammars is None:
            return None  # the fixed engine refuses it in add()
        return self.grammars.guide(sampling.guided)

    # The step loop -----------------------------------------------------------------------

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending, self._pending = self._pending, []
            for msg in pending:
                self.apply(msg)
            workers, self._new_workers = self._new_workers, None
            if workers is not None:
                self.workers_changed(workers)
            self.between_steps()
            if not self.engine.has_work:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.idle_timeout())
                continue
            began = time.time()
            try:
                events = await loop.run_in_executor(self._step_thread, self.engine.step)
            except StepOutOfMemory as exc:
                self.on_out_of_memory(exc)
                continue
            except Exception:
                log.exception("engine step failed; failing %d requests", self.inflight())
                broken = self.ranks.wait_dead(1.0) if self.ranks is not None else None
                self.fail_all("the engine failed" + (f": {broken}" if broken else ""))
                await asyncio.sleep(FAIL_FLUSH_S)  # the errors out of the peers' backlogs
                os._exit(1)  # the engine's state is unknown: let the supervisor restart us
            self._step_span = (began, time.time())
            self.stages.observe("step", self._step_span[1] - began)
            self.on_events(events)

    def wake(self) -> None:
        self._wake.set()

    # Hooks of the roles (hybrid here) ------------------------------------------------------

    accepted: tuple[type, ...] = (protocol.Generate, protocol.Abort)

    def apply(self, msg: Message) -> None:
        """Apply one queued message; runs between steps."""
        if isinstance(msg, protocol.Generate):
            seq = self.admit(msg)
            if seq is None:
                return
            try:
                self.engine.add(seq)
            except ValueError as exc:
                self.error(msg.reply_to, msg.request_id, "invalid_request_error", str(exc))
                return
            self._reply_to[msg.request_id] = msg.reply_to
            self.clients.note(msg.reply_to, self.workers)
        elif isinstance(msg, protocol.Abort):
            self.engine.abort(msg.request_id)
            self._reply_to.pop(msg.request_id, None)

    def workers_changed(self, workers: dict[str, int]) -> None:
        """ClusterState changed the running workers; runs between steps. Drops the
        requests of receivers whose process is gone (roles add their peers' checks)."""
        for name, replaced in self.clients.gone(workers):
            dropped = self.drop_requests_of(name)
            log.warning("%s is gone; dropped its %d requests", name, len(dropped))
            if replaced:  # a new process has the name: it may have sent some of them
                for request_id in dropped:
                    self.error(name, request_id, "service_unavailable", f"{name} restarted; retry")

    def drop_requests_of(self, receiver: str) -> list[str]:
        """Abort every request answering to `receiver` and free its blocks; their ids."""
        dropped = [rid for rid, reply_to in self._reply_to.items() if reply_to == receiver]
        for request_id in dropped:
            self.engine.abort(request_id)
            del self._reply_to[request_id]
        return dropped

    def between_steps(self) -> None:
        """Periodic work of the role, between two steps."""

    def idle_timeout(self) -> float | None:
        """How long the loop may wait for a message when there is nothing to compute."""
        return None

    def on_events(self, events: list[TokenEvent]) -> None:
        self.publish(events)

    def fail_all(self, message: str) -> None:
        for request_id, reply_to in list(self._reply_to.items()):
            self.error(reply_to, request_id, "internal_error", message)

    def on_out_of_memory(self, exc: StepOutOfMemory) -> None:
        """A step's allocation failed: the engine dropped that step's requests; they fail
        with a 503 (retry), the rest go on."""
        memory = self.engine.memory if isinstance(self.engine, Engine) else None
        log.error(
            "%s: %s; failing them and serving on (memory plan: %s)",
            self.spec.name,
            exc,
            describe(memory) if memory else "none",
        )
        message = "the server ran out of GPU memory for this request's step; retry"
        self.fail_requests(exc.request_ids, "service_unavailable", message)

    def fail_requests(self, request_ids: list[str], code: str, message: str) -> None:
        """Answer these requests with an error and forget them (the engine freed them)."""
        for request_id in request_ids:
            reply_to = self._reply_to.pop(request_id, None)
            if reply_to is not None:
                self.error(reply_to, request_id, code, message)

    # Shared helpers --------------------------------------------------------------------------

    def admit(self, msg: protocol.Generate) -> Sequence | None:
        """The request as a Sequence, or None after answering why it cannot run."""
        if self.draining:
            self.error(
                msg.reply_to, msg.request_id, "service_unavailable", "the server is draining"
            )
            return None
        if msg.request_id in self._reply_to:
            self.error(
                msg.reply_to,
                msg.request_id,
                "invalid_request_error",
                f"request id {msg.request_id} is already running",
            )
            return None
        try:
            seq = Sequence(msg.request_id, msg.prompt_token_ids, SamplingParams(**msg.sampling))
            seq.guide = self.new_guide(seq.sampling)
            return seq
        except (TypeError, ValueError) as exc:
            self.error(msg.reply_to, msg.request_id, "invalid_request_error", str(exc))
            return None

    def publish(self, events: list[TokenEvent]) -> None:
        """Send sampled tokens to each request's receiver; forget finished requests."""
        by_receiver: dict[str, list[TokenEvent]] = defaultdict(list)
        for event in events:
            reply_to = self._reply_to.get(event.request_id)
            if reply_to is None:
                continue  # aborted while the step ran
            if event.position == 0:
                self.first_token(event.request_id)
            by_receiver[reply_to].append(event)
            if event.finish_reason is not None:
                del self._reply_to[event.request_id]
        for reply_to, batch in by_receiver.items():
            self.send_tokens(reply_to, batch)

    def first_token(self, request_id: str) -> None:
        """The step that just ran sampled the request's first token: its queue and
        prefill stages end (stage_times.py)."""
        began, ended = self._step_span
        self.clock.lap(request_id, "queue", began)
        self.clock.stop(request_id, "prefill", ended)

    def send_tokens(self, reply_to: str, events: list[TokenEvent]) -> None:
        msg = protocol.Tokens(
            [e.request_id for e in events],
            [None if e.finish_reason is None else str(e.finish_reason) for e in events],
            [logprobs_dict(e) for e in events],
            [e.cached_tokens for e in events],
            protocol.pack_ids([e.token_id for e in events]),
            protocol.pack_ids([e.position for e in events]),
            time.time(),
        )
        self.push(reply_to, msg)

    def error(self, reply_to: str, request_id: str, code: str, message: str) -> None:
        self.push(reply_to, protocol.RequestError(request_id, code, message))


def logprobs_dict(event: TokenEvent) -> dict[str, Any] | None:
    lp = event.logprobs
    if lp is None:
        return None
    return {"logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]}
