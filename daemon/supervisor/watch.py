"""Each tick, each worker: reap its exit, kill it if overdue, start it again when due.

What happens to a worker process (Child.state):
  1. It exits. While the daemon stops, it is just stopped. A retired one (scaling.py) is
     forgotten. Otherwise its exit is counted against the restart policy: restart it
     after a backoff (RESTARTING), or, after too many fast failures in a row, give up
     on the daemon (FAILED).
  2. It is overdue (no heartbeat for heartbeat_timeout, not ready within
     startup_timeout, not gone within the grace after SIGTERM): SIGKILL, then 1. One
     that missed its heartbeats counts as hung until its replacement is ready (the
     systemd watchdog pings stop meanwhile).
  3. Its backoff ran out: spawned again (STARTING).
`WorkerWatch.tick` acts on the process and tells the supervisor what the daemon must do
about it; it never touches the daemon's state itself.
"""

from __future__ import annotations

import enum
import logging
import signal
from dataclasses import dataclass

from lmd.api.metrics import forget_process
from lmd.config import ServeConfig
from lmd.paths import metrics_dir
from lmd.protocol.roles import Role
from lmd.supervisor.child import Child, describe_exit
from lmd.supervisor.scaling import Scaler
from lmd.supervisor.states import WorkerState
from lmd.worker import EXIT_CANNOT_START

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # after Stop or SIGTERM, how long a worker may take to exit
LIVE = (WorkerState.STARTING, WorkerState.RUNNING)


class Change(enum.Enum):
    WORKERS = "workers"  # the set of running workers changed: publish it


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


class WorkerWatch:
    def __init__(self, scaler: Scaler) -> None:
        self.scaler = scaler
        self.hung: set[str] = set()  # killed for missing heartbeats, not yet back

    def tick(
        self, child: Child, now: float, config: ServeConfig, stopping: bool
    ) -> Change | GiveUp | None:
        if child.state in LIVE:
            code = child.exit_code()
            if code is not None:
                return self._on_exit(child, code, now, config, stopping)
            if reason := child.overdue(
                now, config.heartbeat_timeout, config.startup_timeout, STOP_GRACE_S
            ):
                log.error("%s (pid %s) %s; killing it", child.name, child.pid, reason)
                if child.missed_heartbeats(now, config.heartbeat_timeout):
                    self.hung.add(child.name)  # the watchdog stops until it is back
                child.signal(signal.SIGKILL)
        elif (
            child.state == WorkerState.RESTARTING
            and not stopping
            and child.next_start_at is not None
            and now >= child.next_start_at
        ):
            child.num_restarts += 1
            log.info("restarting %s (restart #%d)", child.name, child.num_restarts)
            child.spawn()
        return None

    def ready(self, child: Child) -> None:
        self.hung.discard(child.name)

    def _on_exit(
        self, child: Child, code: int, now: float, config: ServeConfig, stopping: bool
    ) -> Change | GiveUp | None:
        if child.role == Role.API and child.pid is not None:  # its requests ended with it
            forget_process(metrics_dir(config.runtime_dir), child.pid)
        if stopping:
            child.last_exit = code
            child.set_state(WorkerState.STOPPED)
            return None
        if self.scaler.forget(child):
            return Change.WORKERS
        if child.restart_requested_at is None:
            ran = now - child.started_mono
            log.warning(
                "%s (pid %s) died (%s) after %.1f s",
                child.name,
                child.pid,
                describe_exit(code),
                ran,
            )
        if code == EXIT_CANNOT_START:  # it said why in its log; a restart would too
            child.last_exit = code
            child.set_state(WorkerState.FAILED)
            return GiveUp(f"{child.name} cannot start (see its error above); not restarting it")
        policy = config.restart
        delay = child.record_exit(code, now, policy)
        if delay is None:
            child.set_state(WorkerState.FAILED)
            return GiveUp(
                f"{child.name} died {child.num_fast_failures} times in a row "
                f"within {policy.stable_after_s:.0f} s of starting (last: {describe_exit(code)})"
            )
        child.set_state(WorkerState.RESTARTING)
        child.next_start_at = now + delay
        return Change.WORKERS
