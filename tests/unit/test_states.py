from __future__ import annotations

import pytest

from lmd.supervisor.states import DaemonState, TransitionError, WorkerState, transition


def test_daemon_lifecycle() -> None:
    s = DaemonState.STARTING
    for nxt in (
        DaemonState.RUNNING,
        DaemonState.DRAINING,
        DaemonState.RUNNING,
        DaemonState.STOPPING,
    ):
        s = transition(s, nxt)
    assert s == DaemonState.STOPPING
    with pytest.raises(TransitionError, match="cannot go from stopping to running"):
        transition(s, DaemonState.RUNNING)
    with pytest.raises(TransitionError):
        transition(DaemonState.STARTING, DaemonState.DRAINING)


def test_worker_lifecycle() -> None:
    s = WorkerState.STARTING
    for nxt in (
        WorkerState.RUNNING,
        WorkerState.RESTARTING,
        WorkerState.STARTING,
        WorkerState.FAILED,
        WorkerState.STOPPED,
    ):
        s = transition(s, nxt)
    with pytest.raises(TransitionError):
        transition(WorkerState.STOPPED, WorkerState.STARTING)
    with pytest.raises(TransitionError):
        transition(WorkerState.RESTARTING, WorkerState.RUNNING)  # must start first


def test_same_state_is_allowed() -> None:
    assert transition(WorkerState.RUNNING, WorkerState.RUNNING) == WorkerState.RUNNING
