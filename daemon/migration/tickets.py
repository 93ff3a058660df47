"""The tickets of a request's KV copy: one per decode rank this process writes to, and
the other ranks' of its tensor-parallel group (sender.py), seen as one."""

from __future__ import annotations

import threading
import time
from typing import Any

from lmd.migration.base import TicketLike


class RemoteCopies:
    """The other ranks' part of a request's copy: done when each rank answered."""

    def __init__(self, decode: str) -> None:
        self.decode = decode
        self._done = threading.Event()
        self.nbytes = 0
        self.error = ""

    def done(self, replies: list[dict[str, Any]]) -> None:
        self.nbytes = sum(int(r.get("nbytes", 0)) for r in replies)
        failed = [r for r in replies if not r.get("ok")]
        if failed:
            self.error = f"rank {failed[0].get('rank')}: {failed[0].get('error')}"
        self._done.set()

    def wait(self, timeout_s: float | None) -> bool:
        if not self._done.wait(timeout_s):
            return False
        if self.error:
            raise RuntimeError(f"KV copy to {self.decode} failed on {self.error}")
        return True


class GroupTicket:
    """A request's copies: this rank's (one ticket per decode rank it writes to) and,
    in a tensor-parallel group, the other ranks'."""

    def __init__(self, tickets: list[TicketLike], remote: RemoteCopies | None) -> None:
        self.tickets = tickets
        self.remote = remote

    @property
    def nbytes(self) -> int:
        mine = sum(t.nbytes for t in self.tickets)
        return mine + (self.remote.nbytes if self.remote is not None else 0)

    def poll(self) -> bool:
        if not all(t.poll() for t in self.tickets):
            return False
        return self.remote is None or self.remote.wait(0)

    def wait(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for ticket in self.tickets:
            if not ticket.wait(_left(deadline)):
                return False
        return self.remote is None or self.remote.wait(_left(deadline))


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class DoneTicket:
    """Nothing to copy (decode caches the whole prompt already)."""

    nbytes = 0

    def poll(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        return True
