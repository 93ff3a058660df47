"""What the supervisor tells systemd: its life cycle in sd_notify words, and the watchdog.

    starting    STATUS=starting N workers
    running     READY=1 once every worker sent Ready (the api sends Ready only after its
                port listens, so READY means the HTTP API accepts connections);
                STATUS=serving N workers, or restarting NAME[, NAME] while one is down
    draining    STATUS=draining (`lmdctl drain`; the service keeps running: no STOPPING)
    stopping    STOPPING=1 + STATUS=stopping (REASON): SIGTERM, shutdown, giving up
    reload      RELOADING=1 + MONOTONIC_USEC=, then READY=1 when the reload is done
    watchdog    WATCHDOG=1 every half $WATCHDOG_USEC, sent from the supervisor's tick loop
                and only while it reports itself healthy: a stuck loop, or a hung worker
                not yet replaced, stops the pings and systemd restarts the service.

Without $NOTIFY_SOCKET every call is a no-op (sd_notify.Notifier).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

from lmd.supervisor.sd_notify import Notifier
from lmd.supervisor.states import DaemonState, WorkerState


def status_line(state: DaemonState, workers: Mapping[str, WorkerState], stop_reason: str) -> str:
    """The one line systemd shows for the daemon (STATUS=)."""
    if state == DaemonState.STOPPING:
        return f"stopping ({stop_reason})"
    if state == DaemonState.DRAINING:
        return "draining"
    if state == DaemonState.STARTING:
        return f"starting {len(workers)} workers"
    down = [name for name, s in workers.items() if s != WorkerState.RUNNING]
    return f"restarting {', '.join(down)}" if down else f"serving {len(workers)} workers"


class ServiceNotifier:
    def __init__(self, notifier: Notifier | None = None) -> None:
        self.notifier = notifier or Notifier()
        self._status = ""  # the last STATUS= sent, so that repeats are not sent
        self._next_ping = 0.0  # monotonic time the next WATCHDOG=1 is due

    def status(self, text: str) -> None:
        if text != self._status:
            self._status = text
            self.notifier.status(text)

    def ready(self, status: str) -> None:
        self._status = status
        self.notifier.ready(status)

    def stopping(self, status: str) -> None:
        self._status = status
        self.notifier.stopping(status)

    @contextlib.contextmanager
    def reloading(self, status_after: Callable[[], str]) -> Iterator[None]:
        """RELOADING=1 for the body, READY=1 (with `status_after()`) after it, even on error."""
        self._status = "reloading the configuration"
        self.notifier.reloading(self._status)
        try:
            yield
        finally:
            self.ready(status_after())

    def watchdog(self, now: float, healthy: bool) -> None:
        """Ping if one is due and the daemon is healthy (call every tick; `now` monotonic)."""
        interval = self.notifier.watchdog_interval
        if interval is None or not healthy or now < self._next_ping:
            return
        self.notifier.watchdog()
        self._next_ping = now + interval

    def close(self) -> None:
        self.notifier.close()
