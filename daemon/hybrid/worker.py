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
Sends never wait: a receiver that is gone or not reading loses its tokens (counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmd import protocol
from lmd.engine.backend import BackendError
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine, TokenEvent
from lmd.engine.fixed_engine import FixedTokenEngine, FixedTokens
from lmd.engine.model_source import ModelSourceError, resolve_model
from lmd.engine.sequence import SamplingParams, Sequence
from lmd.engine.stage_clock import StageClock
from lmd.migration.base import PoolMemory
from lmd.migration.transports import pool_memory
from lmd.protocol import Message, Role
from lmd.roles import num_engine_workers
from lmd.worker import Worker, WorkerStartError

log = logging.getLogger(__name__)


class EngineWorker(Worker):
    role = Role.HYBRID
    engine: Engine | FixedTokenEngine  # the disaggregated roles run an Engine

    async def start(self) -> None:
        device = self.spec.device or "cpu"
        self.memory: PoolMemory | None = None
        try:
            model = resolve_model(self.config.model)
            if self.role != Role.HYBRID:
                self.memory = pool_memory(device, self.config.migration_transport)
            if self.spec.backend == "fixed":  # hybrid only (config.py)
                self.engine = FixedTokenEngine(FixedTokens(model.path), self.engine_config())
            else:
                engine = await asyncio.to_thread(
                    Engine.build,
                    model.path,
                    self.engine_config(),
                    device=device,
                    dtype=self.config.dtype,
                    backend=self.spec.backend or "auto",
                    role=self.role,
                    pool_buffer=None if self.memory is None else self.memory.buffer,
                    cpu_engines=num_engine_workers(self.config),
                )
                if self.memory is not None:
                    self.memory.attach(engine.pool)
                self.engine = engine
        except (ModelSourceError, BackendError, ValueError, OSError, RuntimeError) as exc:
            raise WorkerStartError(str(exc)) from None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.spec.name}-step")
        self._reply_to: dict[str, str] = {}  # request id -> receiving worker
        self._pending: list[Message] = []
        self.clock = StageClock()  # where time to first token goes in this worker
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._step_loop())

    def engine_config(self) -> EngineConfig:
        return self.config.engine

    async def stop(self) -> None:
        self._loop_task.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.memory is not None:
            self.memory.close()

    def info(self) -> dict[str, Any]:
        b = self.engine.backend
        info = {"backend": b.name, "device": str(b.device), "dtype": str(b.dtype)[6:]}
        if self.memory is not None:
            info["transport"] = self.memory.transport.name
        return info

    def stats(self) -> dict[str, Any]:
        return {
            **self.engine.stats(),
            "num_steps": self.engine.num_steps,
            "stages_ms": self.clock.to_dict(),
        }

    def inflight(self) -> int:
        return len(self._reply_to)

    async def handle(self, msg: Message) -> bool:
        if not isinstance(msg, self.accepted):
            return False
        if isinstance(msg, protocol.Generate):
            self.clock.start(msg.request_id)
        self._pending.append(msg)
        self._wake.set()
        return True

    # The step loop -----------------------------------------------------------------------

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending, self._pending = self._pending, []
            for msg in pending:
                self.apply(msg)
            self.between_steps()
            if not self.engine.has_work:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.idle_timeout())
                continue
            try:
                events = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception:
                log.exception("engine step failed; failing %d requests", self.inflight())
                self.fail_all("the engine failed")
                os._exit(1)  # the engine's state is unknown: let the supervisor restart us
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
        elif isinstance(msg, protocol.Abort):
            self.engine.abort(msg.request_id)
            self._reply_to.pop(msg.request_id, None)

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

    # Shared helpers --------------------------------------------------------------------------

    def admit(self, msg: protocol.Generate) -> Sequence | None:
        """The request as a Sequence, or None after answering why it cannot run."""
        if self.draining:
            self.error(msg.reply_to, msg.request_id, "overloaded", "the server is draining")
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
            return Sequence(msg.request_id, msg.prompt_token_ids, SamplingParams(**msg.sampling))
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
                self.clock.stop(event.request_id, "to_first_token")
            by_receiver[reply_to].append(event)
            if event.finish_reason is not None:
                del self._reply_to[event.request_id]
        for reply_to, batch in by_receiver.items():
            self.send_tokens(reply_to, batch)

    def send_tokens(self, reply_to: str, events: list[TokenEvent]) -> None:
        msg = protocol.Tokens(
            [e.request_id for e in events],
            [None if e.finish_reason is None else str(e.finish_reason) for e in events],
            [logprobs_dict(e) for e in events],
            [e.cached_tokens for e in events],
            protocol.pack_ids([e.token_id for e in events]),
            protocol.pack_ids([e.position for e in events]),
        )
        self.push(reply_to, msg)

    def error(self, reply_to: str, request_id: str, code: str, message: str) -> None:
        self.push(reply_to, protocol.RequestError(request_id, code, message))


def logprobs_dict(event: TokenEvent) -> dict[str, Any] | None:
    lp = event.logprobs
    if lp is None:
        return None
    return {"logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]}
