"""What a supervisor operation (restart, scale, drain, resume, reload) can refuse.

Each error carries a short `code` for machines and a one-line message for people; the
control API (control.py) alone turns them into HTTP statuses.
"""

from __future__ import annotations


class SupervisorError(Exception):
    """An operation the daemon refuses; nothing was changed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class UnknownWorker(SupervisorError):
    """No worker has that name."""


class WrongState(SupervisorError):
    """Not now: the daemon (or the worker) is in a state that does not allow it."""


class BadArgument(SupervisorError):
    """The operation's arguments are out of range."""


class BadConfig(SupervisorError):
    """The config a reload read is not valid; the running one stays."""
