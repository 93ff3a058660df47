"""The supervisor's record of one worker process: spawn, watch, kill, report.

A Child outlives the processes it runs: on a restart the record stays (name, counters)
and a new process is spawned into it. State changes go through states.transition.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from lmd.config import RestartPolicy
from lmd.protocol import Heartbeat
from lmd.roles import WorkerSpec
from lmd.spawn import worker_main
from lmd.supervisor.states import WorkerState, transition

_SPAWN = multiprocessing.get_context("spawn")


class Child:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.state = WorkerState.STARTING
        self.process: BaseProcess | None = None
        self.num_restarts = 0
        self.num_fast_failures = 0  # consecutive runs that died young
        self.started_at = 0.0  # wall clock (time.time) of the current process
        self.started_mono = 0.0
        self.last_seen = 0.0  # monotonic time of the last message from it
        self.next_start_at: float | None = None  # monotonic; set while restarting
        self.restart_requested_at: float | None = None  # monotonic
        self.last_exit: int | None = None
        self.scaled_in = False  # added by lmdctl scale and not yet Ready once
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.inflight = 0
        self.num_dropped = 0
        # lmdctl scale removed it (scaling.py): no new work, stopped once idle, not restarted.
        self.retiring = False
        self.retire_started = 0.0
        self.stop_sent = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def heard(self, beat: Heartbeat) -> None:
        self.last_seen = time.monotonic()
        self.inflight, self.num_dropped, self.stats = beat.inflight, beat.num_dropped, beat.stats

    def missed_heartbeats(self, now: float, timeout: float) -> bool:
        return self.state == WorkerState.RUNNING and now - self.last_seen > timeout

    def overdue(
        self, now: float, heartbeat_timeout: float, startup_timeout: float, stop_grace: float
    ) -> str | None:
        """Why this live process must be killed now (for the log), or None."""
        if self.missed_heartbeats(now, heartbeat_timeout):
            return f"sent no heartbeat for {now - self.last_seen:.0f} s"
        if self.restart_requested_at is not None and now - self.restart_requested_at > stop_grace:
            return f"did not exit within {stop_grace:.0f} s of SIGTERM"
        if self.state == WorkerState.STARTING and now - self.started_mono > startup_timeout:
            return f"not ready after {now - self.started_mono:.0f} s"
        return None

    def record_exit(self, code: int, now: float, policy: RestartPolicy) -> float | None:
        """Count an exit: seconds to wait before the next start, or None to give up.

        A restart that was asked for costs nothing; a death within stable_after_s of
        starting (or before Ready) is a fast failure, and max_fast_failures in a row give up.
        """
        self.last_exit = code
        if self.restart_requested_at is not None:
            self.restart_requested_at = None
            return 0.0
        fast = self.state == WorkerState.STARTING or now - self.started_mono < policy.stable_after_s
        self.num_fast_failures = self.num_fast_failures + 1 if fast else 0
        if self.num_fast_failures >= policy.max_fast_failures:
            return None
        return policy.delay(self.num_fast_failures)

    def set_state(self, new: WorkerState) -> None:
        self.state = transition(self.state, new)

    def spawn(self) -> None:
        self.set_state(WorkerState.STARTING)
        self.process = _SPAWN.Process(
            target=worker_main, args=(self.spec.to_dict(),), name=self.name
        )
        self.process.start()
        self.started_at = time.time()
        self.started_mono = self.last_seen = time.monotonic()
        self.next_start_at = None
        self.info, self.stats, self.inflight = {}, {}, 0

    def exit_code(self) -> int | None:
        """The exit code once the process has ended (reaps it), else None."""
        if self.process is None:
            return None
        return self.process.exitcode  # waitpid(WNOHANG) under the hood

    def signal(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, sig)

    def join(self, timeout: float) -> None:
        if self.process is not None:
            self.process.join(timeout)

    def rss_bytes(self) -> int | None:
        if self.process is None or self.exit_code() is not None or self.pid is None:
            return None
        try:
            return int(psutil.Process(self.pid).memory_info().rss)
        except psutil.Error:
            return None

    def to_status(self) -> dict[str, Any]:
        running = self.state in (WorkerState.STARTING, WorkerState.RUNNING)
        status: dict[str, Any] = {
            "name": self.name,
            "role": self.role,
            "pid": self.pid if running else None,
            "state": str(self.state),
            "backend": self.info.get("backend", self.spec.backend),
            "device": self.info.get("device", self.spec.device),
            "restarts": self.num_restarts,
            "rss_bytes": self.rss_bytes() if running else None,
            "started_at": self.started_at or None,
            "inflight": self.inflight,
            "num_dropped": self.num_dropped,
            "last_exit_code": self.last_exit,
        }
        if self.retiring:
            status["retiring"] = True
        status.update({k: v for k, v in self.stats.items() if k not in status and k != "rss_bytes"})
        status.update({k: v for k, v in self.info.items() if k not in status})
        return status


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
