"""hybrid/step_thread.py: one daemon thread runs an engine worker's torch calls in order
(its build and its steps: a second thread's OpenMP pool slows every CPU step), errors
reach the caller, and shutdown cancels what has not started."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lmd.hybrid.step_thread import StepThread


def test_calls_run_in_order_on_one_daemon_thread() -> None:
    thread = StepThread("t-step")
    try:
        seen: list[tuple[int, threading.Thread]] = []
        futures = [
            thread.submit(lambda i=i: seen.append((i, threading.current_thread())))
            for i in range(20)
        ]
        for f in futures:
            f.result(timeout=10)
        assert [i for i, _ in seen] == list(range(20))
        runners = {t for _, t in seen}
        assert len(runners) == 1
        (runner,) = runners
        assert (
            runner.name == "t-step" and runner.daemon and runner is not threading.current_thread()
        )
    finally:
        thread.shutdown()


def test_an_error_reaches_the_caller_and_the_thread_goes_on() -> None:
    thread = StepThread("t-step")
    try:
        with pytest.raises(ZeroDivisionError):
            thread.submit(lambda: 1 / 0).result(timeout=10)
        assert thread.submit(lambda: 2 + 2).result(timeout=10) == 4
    finally:
        thread.shutdown()


async def test_run_in_executor_awaits_it() -> None:
    thread = StepThread("t-step")
    try:
        loop = asyncio.get_running_loop()
        name = await loop.run_in_executor(thread, lambda: threading.current_thread().name)
        assert name == "t-step"
    finally:
        thread.shutdown()


def test_shutdown_cancels_what_has_not_started_and_refuses_more() -> None:
    thread = StepThread("t-step")
    started, release = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return release.wait(10)

    running = thread.submit(hold)
    assert started.wait(10)
    queued = thread.submit(lambda: "never")
    thread.shutdown(wait=False, cancel_futures=True)
    release.set()
    assert running.result(timeout=10) is True
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        thread.submit(lambda: None)
    thread.shutdown()  # again: joins, nothing else
