"""A Child's restart bookkeeping and kill timers, without spawning anything."""

from __future__ import annotations

from lmd.config import RestartPolicy
from lmd.protocol import Role
from lmd.roles import WorkerSpec
from lmd.supervisor.child import Child
from lmd.supervisor.states import WorkerState

POLICY = RestartPolicy(backoff_s=0.5, max_backoff_s=30.0, stable_after_s=30.0, max_fast_failures=3)


def child(state: WorkerState = WorkerState.RUNNING, started: float = 0.0) -> Child:
    c = Child(WorkerSpec("decode-0", Role.DECODE, 0, supervisor_pid=1, config={}))
    c.state, c.started_mono, c.last_seen = state, started, started
    return c


def test_fast_failures_back_off_then_give_up() -> None:
    c = child()
    assert c.record_exit(-9, now=1.0, policy=POLICY) == 0.5
    assert c.record_exit(-9, now=2.0, policy=POLICY) == 1.0
    assert c.record_exit(1, now=3.0, policy=POLICY) is None  # third fast failure: give up
    assert c.last_exit == 1


def test_a_long_run_resets_the_count_and_a_requested_restart_costs_nothing() -> None:
    c = child()
    c.record_exit(-9, now=1.0, policy=POLICY)
    assert c.record_exit(-9, now=100.0, policy=POLICY) == 0.0  # ran 100 s: not fast
    assert c.num_fast_failures == 0
    c.restart_requested_at = 5.0
    assert c.record_exit(0, now=6.0, policy=POLICY) == 0.0
    assert c.num_fast_failures == 0 and c.restart_requested_at is None


def test_a_death_before_ready_is_always_fast() -> None:
    c = child(WorkerState.STARTING)
    assert c.record_exit(1, now=100.0, policy=POLICY) == 0.5


def test_overdue_names_why_a_process_must_go() -> None:
    running = child(WorkerState.RUNNING)
    assert running.overdue(10.0, 15.0, 300.0, 5.0) is None
    assert running.overdue(20.0, 15.0, 300.0, 5.0) == "sent no heartbeat for 20 s"
    assert running.missed_heartbeats(20.0, 15.0)
    starting = child(WorkerState.STARTING)
    assert starting.overdue(301.0, 15.0, 300.0, 5.0) == "not ready after 301 s"
    assert not starting.missed_heartbeats(301.0, 15.0)
    stopping = child(WorkerState.RUNNING, started=100.0)
    stopping.restart_requested_at = 100.0
    assert stopping.overdue(106.0, 15.0, 300.0, 5.0) == "did not exit within 5 s of SIGTERM"
