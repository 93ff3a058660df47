"""What the supervisor does about a worker's exit (supervisor/watch.py), without spawning."""

from __future__ import annotations

from pathlib import Path

from lmd.config import ServeConfig
from lmd.protocol import Role
from lmd.roles import WorkerSpec
from lmd.supervisor.child import Child
from lmd.supervisor.scaling import Scaler
from lmd.supervisor.states import WorkerState
from lmd.supervisor.watch import GiveUp, WorkerWatch
from lmd.worker import EXIT_CANNOT_START


def exited(code: int) -> Child:
    c = Child(WorkerSpec("decode-0", Role.DECODE, 0, supervisor_pid=1, config={}))
    c.state = WorkerState.STARTING
    c.exit_code = lambda: code  # type: ignore[method-assign]
    return c


def test_a_worker_that_cannot_start_makes_the_daemon_give_up_at_once(tmp_path: Path) -> None:
    """Its GPU memory plan cannot hold it: a restart would fail the same way, so there is
    no restart loop (max_fast_failures of them, with backoff) before the daemon exits."""
    c = exited(EXIT_CANNOT_START)
    watch = WorkerWatch(Scaler({c.name: c}))
    outcome = watch.tick(c, 10.0, ServeConfig(tmp_path), stopping=False)
    assert isinstance(outcome, GiveUp)
    assert outcome.reason == "decode-0 cannot start (see its error above); not restarting it"
    assert c.state == WorkerState.FAILED and c.num_restarts == 0


def test_any_other_death_before_ready_is_restarted_after_a_backoff(tmp_path: Path) -> None:
    c = exited(1)
    watch = WorkerWatch(Scaler({c.name: c}))
    assert not isinstance(watch.tick(c, 10.0, ServeConfig(tmp_path), stopping=False), GiveUp)
    assert c.state == WorkerState.RESTARTING
