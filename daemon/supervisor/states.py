"""Lifecycle states of the daemon and of each worker, with the allowed transitions.

Daemon:  starting -> running <-> draining;  any -> stopping (terminal).
    `draining` stops admitting new requests but keeps serving what is in flight
    (`lmdctl drain`); `resume` returns to running. SIGTERM/`shutdown` go to stopping,
    which drains and then exits.

Worker:  starting -> running -> restarting -> starting ... ;
    starting/running/restarting -> failed (gave up after repeated fast failures)
    any -> stopped (the daemon is stopping, or the worker was removed).
"""

from __future__ import annotations

import enum
from typing import TypeVar


class TransitionError(RuntimeError):
    """A state change that the lifecycle does not allow."""


class DaemonState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPING = "stopping"

    def can_become(self, new: DaemonState) -> bool:
        return new in _DAEMON_NEXT[self]


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"

    def can_become(self, new: WorkerState) -> bool:
        return new in _WORKER_NEXT[self]


_DAEMON_NEXT: dict[DaemonState, frozenset[DaemonState]] = {
    DaemonState.STARTING: frozenset({DaemonState.RUNNING, DaemonState.STOPPING}),
    DaemonState.RUNNING: frozenset({DaemonState.DRAINING, DaemonState.STOPPING}),
    DaemonState.DRAINING: frozenset({DaemonState.RUNNING, DaemonState.STOPPING}),
    DaemonState.STOPPING: frozenset(),
}

_WORKER_NEXT: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset(
        {WorkerState.RUNNING, WorkerState.RESTARTING, WorkerState.FAILED, WorkerState.STOPPED}
    ),
    WorkerState.RUNNING: frozenset(
        {WorkerState.RESTARTING, WorkerState.FAILED, WorkerState.STOPPED}
    ),
    WorkerState.RESTARTING: frozenset(
        {WorkerState.STARTING, WorkerState.FAILED, WorkerState.STOPPED}
    ),
    WorkerState.FAILED: frozenset({WorkerState.STOPPED}),
    WorkerState.STOPPED: frozenset(),
}


S = TypeVar("S", DaemonState, WorkerState)


def transition(current: S, new: S) -> S:
    """Return `new` if `current` may become it, else raise TransitionError."""
    if current != new and not current.can_become(new):
        raise TransitionError(f"cannot go from {current} to {new}")
    return new
