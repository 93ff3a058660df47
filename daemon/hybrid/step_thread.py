"""The one thread that runs an engine worker's torch work: its build, then its steps.

libgomp keeps an OpenMP thread pool for each thread that starts parallel regions. An
engine built in one thread (asyncio.to_thread) and stepped in another left two pools in
the process: more OpenMP threads than the 2-core machine has cores, and libgomp then
spins only briefly at its barriers before sleeping, so each of a CPU decode step's few
hundred parallel regions paid futex wake-ups. SmolLM2 at batch 8: 67-70 ms a step with
everything on one thread, 110-127 ms once a second thread had run torch work, and the
daemon's steps were the slow kind (docs/benchmarks.md, 'CPU, third pass').

A daemon thread: one left waiting in a collective of a dead tensor-parallel rank does not
hold the process's exit (the worker exits with os._exit then anyway).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class StepThread(Executor):
    """An Executor of one daemon thread, calls run in the order submitted."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._closed:
            raise RuntimeError("the step thread is shut down")
        done: Future[T] = Future()
        self._jobs.put((done, fn, args, kwargs))
        return done

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not self._closed:
            self._closed = True
            if cancel_futures:
                self._cancel_queued()
            self._jobs.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _cancel_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[0].cancel()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            done, fn, args, kwargs = job
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller, as an Executor does
                done.set_exception(exc)
