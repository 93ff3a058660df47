"""The engine worker: one Engine in a process, fed by Generate/Abort on its inbox.

Life cycle of a request in the engine worker:
  1. Generate arrives on the inbox: the sampling parameters are checked (a bad value
     answers RequestError to `reply_to`), then the request waits for the next step.
  2. Between two steps the loop applies what arrived: adds (a prompt over the length
     limit answers RequestError) and aborts (blocks freed at once).
  3. `Engine.step` runs in a dedicated thread, so heartbeats and the inbox keep flowing
     while the model computes; the tokens it sampled go out as one Tokens message per
     receiver. A request's last token carries its finish reason.
  4. If a step raises, every request in flight gets RequestError(internal_error) and the
     process exits 1: the supervisor restarts it with a fresh engine.
Sends never wait: a receiver that is gone or not reading loses its tokens (counted).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmd import protocol
from lmd.engine.backend import BackendError
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine, TokenEvent
from lmd.engine.model_source import ModelSourceError, resolve_model
from lmd.engine.sequence import SamplingParams, Sequence
from lmd.protocol import Message
from lmd.worker import Worker, WorkerStartError

log = logging.getLogger(__name__)


class EngineWorker(Worker):
    role = "hybrid"

    async def start(self) -> None:
        try:
            model = resolve_model(self.config.model)
            self.engine = await asyncio.to_thread(
                Engine.build,
                model.path,
                self.engine_config(),
                device=self.spec.device or "cpu",
                dtype=self.config.dtype,
                backend=self.spec.backend or "auto",
            )
        except (ModelSourceError, BackendError, ValueError, OSError) as exc:
            raise WorkerStartError(str(exc)) from None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.spec.name}-step")
        self._reply_to: dict[str, str] = {}  # request id -> receiving worker
        self._adds: list[tuple[Sequence, str]] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._step_loop())

    def engine_config(self) -> EngineConfig:
        return self.config.engine

    async def stop(self) -> None:
        self._loop_task.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def info(self) -> dict[str, Any]:
        b = self.engine.backend
        return {"backend": b.name, "device": str(b.device), "dtype": str(b.dtype)[6:]}

    def stats(self) -> dict[str, Any]:
        return {
            **self.engine.stats(),
            "num_steps": self.engine.num_steps,
        }

    def inflight(self) -> int:
        return len(self._reply_to)

    async def handle(self, msg: Message) -> bool:
        if isinstance(msg, protocol.Generate):
            self._admit(msg)
        elif isinstance(msg, protocol.Abort):
            self._aborts.append(msg.request_id)
        else:
            return False
        self._wake.set()
        return True

    def _admit(self, msg: protocol.Generate) -> None:
        if self.draining:
            self._error(msg.reply_to, msg.request_id, "overloaded", "the server is draining")
            return
        if msg.request_id in self._reply_to:
            self._error(
                msg.reply_to,
                msg.request_id,
                "invalid_request_error",
                f"request id {msg.request_id} is already running",
            )
            return
        try:
            sampling = SamplingParams(**msg.sampling)
            seq = Sequence(msg.request_id, msg.prompt_token_ids, sampling)
        except (TypeError, ValueError) as exc:
            self._error(msg.reply_to, msg.request_id, "invalid_request_error", str(exc))
            return
        self._reply_to[msg.request_id] = msg.reply_to
        self._adds.append((seq, msg.reply_to))

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                events = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception:
                log.exception("engine step failed; failing %d requests", len(self._reply_to))
                for request_id, reply_to in list(self._reply_to.items()):
                    self._error(reply_to, request_id, "internal_error", "the engine failed")
                os._exit(1)  # the engine's state is unknown: let the supervisor restart us
            self._publish(events)

    def _apply_pending(self) -> None:
        adds, self._adds = self._adds, []
        for seq, reply_to in adds:
            if seq.request_id in self._aborts:
                continue
            try:
                self.engine.add(seq)
            except ValueError as exc:
                del self._reply_to[seq.request_id]
                self._error(reply_to, seq.request_id, "invalid_request_error", str(exc))
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.engine.abort(request_id)
            self._reply_to.pop(request_id, None)

    def _publish(self, events: list[TokenEvent]) -> None:
        by_receiver: dict[str, list[TokenEvent]] = defaultdict(list)
        for event in events:
            reply_to = self._reply_to.get(event.request_id)
            if reply_to is None:
                continue  # aborted while the step ran
            by_receiver[reply_to].append(event)
            if event.finish_reason is not None:
                del self._reply_to[event.request_id]
        for reply_to, batch in by_receiver.items():
            msg = protocol.Tokens(
                [e.request_id for e in batch],
                [None if e.finish_reason is None else str(e.finish_reason) for e in batch],
                [_logprobs(e) for e in batch],
                [e.cached_tokens for e in batch],
                protocol.pack_ids([e.token_id for e in batch]),
            )
            self.push(reply_to, msg)

    def _error(self, reply_to: str, request_id: str, code: str, message: str) -> None:
        self.push(reply_to, protocol.RequestError(request_id, code, message))


def _logprobs(event: TokenEvent) -> dict[str, Any] | None:
    lp = event.logprobs
    if lp is None:
        return None
    return {"logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]}
