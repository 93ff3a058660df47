"""The sd_notify protocol: tell the service manager (systemd) how the daemon is doing.

A message is one datagram of newline-separated `KEY=VALUE` fields sent to the AF_UNIX
SOCK_DGRAM socket named by $NOTIFY_SOCKET (a path, or an abstract-namespace name when it
starts with '@'). Without $NOTIFY_SOCKET (not run by systemd, or Type= is not notify)
every call is a no-op. See sd_notify(3) and systemd.service(5).

$WATCHDOG_USEC (when $WATCHDOG_PID is unset or is our pid) asks for `WATCHDOG=1` at
least that often; `watchdog_interval` is half of it, as sd_watchdog_enabled(3) advises.

`Notifier.from_environ` removes these variables from the environment, so that the
processes we spawn neither inherit the socket nor try to speak for the service.
Sending never raises (a manager that went away must not take the daemon down with it)
and waits at most SEND_TIMEOUT_S for room in the manager's queue.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# A send waits at most this long for room in the manager's queue (the caller's event
# loop is blocked meanwhile); past it the message is dropped and logged.
SEND_TIMEOUT_S = 1.0


def _address(notify_socket: str) -> str | None:
    """The sendto() address for $NOTIFY_SOCKET, or None for a kind we do not speak."""
    if notify_socket.startswith("@"):
        return "\0" + notify_socket[1:]  # abstract namespace: leading NUL, no file
    if notify_socket.startswith("/"):
        return notify_socket
    return None  # e.g. vsock:CID:PORT (VMs); not needed on a host


def _watchdog_usec(env: Mapping[str, str], pid: int) -> int | None:
    """$WATCHDOG_USEC if it is meant for `pid` and valid, else None."""
    raw_usec, raw_pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    if not raw_usec:
        return None
    if raw_pid and (not raw_pid.isdigit() or int(raw_pid) != pid):
        return None  # the watchdog was asked of another process
    if not raw_usec.isdigit() or int(raw_usec) == 0:
        log.warning("ignoring WATCHDOG_USEC=%r: not a positive integer", raw_usec)
        return None
    return int(raw_usec)


class Notifier:
    """Sends sd_notify messages; every method is a no-op when `enabled` is False."""

    def __init__(self, address: str | None = None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec if address is not None else None
        self._sock: socket.socket | None = None
        self._failed = False  # log the first failed send only

    @classmethod
    def from_env(cls, env: Mapping[str, str], pid: int) -> Notifier:
        raw = env.get("NOTIFY_SOCKET", "")
        if not raw:
            return cls()
        address = _address(raw)
        if address is None:
            log.warning("ignoring NOTIFY_SOCKET=%r: only paths and @abstract names work", raw)
            return cls()
        return cls(address, _watchdog_usec(env, pid))

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """Read $NOTIFY_SOCKET & co. for this process, then unset them (children must not)."""
        environ = os.environ if environ is None else environ
        notifier = cls.from_env(environ, os.getpid())
        for name in ENV_VARS:
            environ.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half the manager's timeout), or None."""
        return None if self.watchdog_usec is None else self.watchdog_usec / 2e6

    def notify(self, *fields: str) -> bool:
        """Send `fields` (each `KEY=VALUE`) in one datagram; True if it was sent."""
        if self.address is None:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.settimeout(SEND_TIMEOUT_S)
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:
            if not self._failed:
                log.warning("sd_notify to %r failed: %s", self.address, exc.strerror or exc)
                self._failed = True
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def stopping(self, status: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def reloading(self, status: str) -> bool:
        """RELOADING=1 with the CLOCK_MONOTONIC time systemd's notify-reload expects."""
        usec = time.monotonic_ns() // 1000  # Python's monotonic clock is CLOCK_MONOTONIC
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
