"""The pipeline's Engine in a thread of its own, as the hybrid worker runs it, minus sockets.

Life cycle of a request in the engine thread:
  1. `add(seqs, sink, delivery=...)` queues the sequences of one call; the thread adds
     them all between two steps (so a call's prompts are scheduled together, as
     `lmd-bench offline` adds its batch before stepping).
  2. The thread steps the engine while it has work; after each step the tokens sampled
     go to their calls' sinks as the call's `Delivery` says: every step's (STEPS: a
     stream, a stop string; the caller's thread detokenizes while the engine computes the
     next step), all of them in fewer, larger lists (HELD: whenever one of the call's
     requests ends, else every HOLD_EVENTS tokens), or only each request's last token,
     when it ends (ENDS: nothing reads the tokens before; the caller takes them from the
     Sequence, which the engine filled, so no per-token work on either side). A sink only
     queues what it gets; each delivery wakes the caller's thread, which then competes
     with this one for the GIL: at batch 64 with a ~2 ms GPU step that costs throughput.
  3. A request's last token carries its finish reason and the thread forgets its call;
     `abort(ids)` drops it earlier and frees its blocks.
  4. `call(fn)` runs fn(engine) between two steps and returns a Future (the scoring
     passes of get_ppl and of the logits outputs use the backend there, never at the
     same time as a step).
  5. A step that raises fails every sink and pending call with that error; the thread
     ends and the pipeline is unusable (a new one starts a fresh engine). `close()`
     fails what is left the same way, ends the thread and drops the engine.
The engine's state only ever changes in this thread, between steps; the thread never
waits on a caller (a sink only queues). The thread builds the engine first, so that its
torch work all runs on one thread (on a CPU, a second thread's OpenMP pool made every
decode step ~1.7x slower: hybrid/step_thread.py).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from lmd.engine.engine import Engine
from lmd.engine.events import TokenEvent
from lmd.engine.sequence import Sequence

log = logging.getLogger(__name__)

T = TypeVar("T")
# What a call's sink receives: the tokens of its requests from one step (or, held, from
# several; or only their last tokens), or the error that ended them (the engine refused
# a sequence, failed, or the pipeline closed).
Item = list[TokenEvent] | BaseException
Sink = Callable[[Item], None]
# A queued operation, and what tells its caller when it will never run.
Op = tuple[Callable[[Engine], None], Callable[[BaseException], None] | None]
HOLD_EVENTS = 1024  # a held call's tokens delivered at least this often (16 steps of 64)


class Delivery(enum.Enum):
    """Which of its requests' TokenEvents a call's sink gets, and when (module doc, 2)."""

    STEPS = "steps"  # every step's, as they come
    HELD = "held"  # all, when one of the call's requests ends, else every HOLD_EVENTS
    ENDS = "ends"  # each request's last one, when it ends


class EngineThread:
    def __init__(self, build: Callable[[], Engine]) -> None:
        """The engine `build` makes, in the thread (its error raised here)."""
        self.engine: Engine | None = None
        self._cond = threading.Condition()
        self._inbox: list[Op] = []
        self._calls: dict[str, _Call] = {}  # request id -> its call
        self._num_every_token = 0  # requests running whose call wants every token
        self._closing = False
        self._error: str | None = None  # why the thread ended early
        built: Future[Engine] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(build, built), name="lmd-pipeline-engine", daemon=True
        )
        self._thread.start()
        self.engine = built.result()

    # From any thread ---------------------------------------------------------------------

    def add(self, seqs: list[Sequence], sink: Sink, *, delivery: Delivery = Delivery.STEPS) -> None:
        """Queue a call's sequences; their tokens (or an error) go to `sink`."""

        def op(engine: Engine) -> None:
            call = _Call(sink, delivery, [])
            for seq in seqs:
                try:
                    engine.add(seq)
                except ValueError as exc:
                    _deliver(sink, exc)
                    continue
                self._calls[seq.request_id] = call
                if delivery is not Delivery.ENDS:
                    self._num_every_token += 1

        self._post(op, lambda error: _deliver(sink, error))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop these requests (those still running) and free their blocks."""
        ids = list(request_ids)

        def op(engine: Engine) -> None:
            for rid in ids:
                if self._forget(rid) is not None:
                    engine.abort(rid)

        if ids and not self.closed:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing runs anyway
                self._post(op)

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """fn(engine) in the engine thread, between two steps."""
        future: Future[T] = Future()

        def op(engine: Engine) -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(engine))
                except Exception as exc:
                    future.set_exception(exc)

        def never(error: BaseException) -> None:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

        self._post(op, never)
        return future

    @property
    def closed(self) -> bool:
        return self._closing or self._error is not None

    def close(self) -> None:
        """Fail what is queued or running, end the thread, drop the engine (idempotent)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self.engine = None

    def _post(
        self, fn: Callable[[Engine], None], never: Callable[[BaseException], None] | None = None
    ) -> None:
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"{self._error}; create a new pipeline")
            if self._closing:
                raise RuntimeError("the pipeline is closed; create a new one")
            self._inbox.append((fn, never))
            self._cond.notify()

    # In the engine thread ----------------------------------------------------------------

    def _run(self, build: Callable[[], Engine], built: Future[Engine]) -> None:
        try:
            engine = build()
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result(engine)
        reason = "the pipeline was closed"
        while True:
            # A look without the lock first: between two steps of a running batch nothing
            # is posted, and the lock and a second look took ~10 us a step on the 2-core
            # dev VM (0.5% of a 2 ms GPU step). What is posted meanwhile is seen after the
            # next step, as when it comes during a step.
            if self._inbox or self._closing or not engine.has_work:
                with self._cond:
                    while not (self._inbox or self._closing or engine.has_work):
                        self._cond.wait()
                    if self._closing:
                        break
                    ops, self._inbox = self._inbox, []
                for fn, _never in ops:
                    fn(engine)
                if not engine.has_work:
                    continue
            try:
                events = engine.step()
            except Exception as exc:
                log.exception("pipeline engine step failed")
                reason = f"the engine failed: {type(exc).__name__}: {exc}"
                with self._cond:
                    self._error = reason
                break
            self._dispatch(events)
        self._fail_all(reason)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        if not self._num_every_token:  # only last tokens are wanted: skip the rest in C
            events = [event for event in events if event.finish_reason is not None]
            if not events:
                return
        by_call: dict[_Call, list[TokenEvent]] = {}
        ended: set[_Call] = set()
        for event in events:
            call = self._calls.get(event.request_id)
            if call is None:
                continue  # aborted while the step ran
            if event.finish_reason is not None:
                self._forget(event.request_id)
                ended.add(call)
            elif call.delivery is Delivery.ENDS:
                continue
            batch = by_call.get(call)
            if batch is None:
                batch = by_call[call] = []
            batch.append(event)
        for call, batch in by_call.items():
            if call.delivery is not Delivery.HELD:
                _deliver(call.sink, batch)
                continue
            call.events += batch
            if len(call.events) >= HOLD_EVENTS or call in ended:
                _deliver(call.sink, call.events)
                call.events = []

    def _forget(self, request_id: str) -> _Call | None:
        """A request ended or was aborted: drop it from its call."""
        call = self._calls.pop(request_id, None)
        if call is not None and call.delivery is not Delivery.ENDS:
            self._num_every_token -= 1
        return call

    def _fail_all(self, reason: str) -> None:
        """Tell every caller still waiting why nothing more comes (an error each: one
        exception object must not be raised in several threads)."""
        with self._cond:
            ops, self._inbox = self._inbox, []
        for _fn, never in ops:
            if never is not None:
                never(RuntimeError(reason))
        sinks = {id(c.sink): c.sink for c in self._calls.values()}  # one error per call
        self._calls.clear()
        self._num_every_token = 0
        for sink in sinks.values():
            _deliver(sink, RuntimeError(reason))


@dataclass(slots=True, eq=False)
class _Call:
    """One add()'s requests in the engine thread (hashed by identity)."""

    sink: Sink
    delivery: Delivery
    events: list[TokenEvent]  # HELD: its tokens not delivered yet


def _deliver(sink: Sink, item: Item) -> None:
    """A sink that raises (its event loop closed) loses its items, not the engine."""
    try:
        sink(item)
    except Exception:
        log.warning("a pipeline caller stopped listening; its tokens are dropped")
