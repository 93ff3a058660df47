"""Run a function in a spawned child process and get back what it reports."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def run_in_child(
    target: Callable[..., None], *args: Any, timeout: float = 60.0, check_exit: bool = True
) -> Any:
    """Call target(conn, *args) in a spawned process; it must send ("ok" | "error", payload).

    Returns the payload of an "ok"; fails the test on an error, a silent child, or (with
    check_exit) a child that does not exit with 0.
    """
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=target, args=(sender, *args), daemon=True)
    child.start()
    sender.close()
    try:
        assert receiver.poll(timeout), "child sent nothing"
        status, payload = receiver.recv()
    finally:
        child.join(timeout=timeout)
        if child.is_alive():
            child.kill()
    assert status == "ok", payload
    if check_exit:
        assert child.exitcode == 0, f"child exited with {child.exitcode}"
    return payload
