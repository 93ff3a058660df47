"""The essential tasks of a worker: the loops without which it only looks alive.

A worker runs several asyncio tasks: its heartbeat, its control and inbox loops, and
what its role adds (an engine's step loop, the api's HTTP server, the tokenizer's
session expiry, a prefill worker's KV copies). When one of them ended on an exception,
the others went on: the heartbeat kept beating, status said running, and every request
hung. Each is now watched: if it ends while the worker runs (it raised, was cancelled,
or returned: a loop never does), its traceback is logged and `on_failure` runs (the
worker then stops its heartbeat and exits 1, and the supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class EssentialTasks:
    def __init__(self, owner: str, on_failure: Callable[[], None]) -> None:
        self.owner = owner  # the worker's name, for the log
        self._on_failure = on_failure
        self._tasks: set[asyncio.Task[Any]] = set()  # held until they end
        self.stopping = False  # set while the worker stops: tasks end, nothing failed
        self.failed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def watch(
        self, work: Coroutine[Any, Any, T] | asyncio.Task[T], what: str, *, may_return: bool = False
    ) -> asyncio.Task[T]:
        """Run `work` (or watch a task already running); `may_return`: a piece of work
        that may end by returning, not a loop."""
        task = work if isinstance(work, asyncio.Task) else asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._ended, what, may_return))
        return task

    def _ended(self, what: str, may_return: bool, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if self.stopping:
            return
        why = "exiting so that the supervisor restarts this worker"
        if task.cancelled():
            log.error("%s: %s was cancelled; %s", self.owner, what, why)
        elif (exc := task.exception()) is not None:
            log.error("%s: %s failed; %s", self.owner, what, why, exc_info=exc)
        elif may_return:
            return
        else:
            log.error("%s: %s returned; %s", self.owner, what, why)
        self.failed = True
        self._on_failure()
