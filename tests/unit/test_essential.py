"""Which ends of a worker's essential tasks fail the worker (lmd.essential)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from lmd.essential import EssentialTasks


async def done() -> None:
    await asyncio.sleep(0)


async def broken() -> None:
    await asyncio.sleep(0)
    raise RuntimeError("a bug")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize("work", [broken, done], ids=["raises", "returns"])
async def test_a_loop_that_ends_fails_the_worker(
    work: Callable[[], Coroutine[Any, Any, None]],
) -> None:
    failures: list[str] = []
    tasks = EssentialTasks("w", lambda: failures.append("exit"))
    tasks.watch(work(), "the loop")
    await settle()
    assert failures == ["exit"] and tasks.failed and len(tasks) == 0


async def test_a_piece_of_work_may_return_but_not_raise() -> None:
    failures: list[str] = []
    tasks = EssentialTasks("w", lambda: failures.append("exit"))
    tasks.watch(done(), "a copy", may_return=True)
    await settle()
    assert failures == [] and not tasks.failed
    tasks.watch(broken(), "a copy", may_return=True)
    await settle()
    assert failures == ["exit"]


async def test_tasks_ended_by_a_stop_fail_nothing() -> None:
    failures: list[str] = []
    tasks = EssentialTasks("w", lambda: failures.append("exit"))
    loop = tasks.watch(asyncio.sleep(3600), "the loop")
    tasks.stopping = True
    loop.cancel()
    await settle()
    assert failures == [] and not tasks.failed
