"""Stop strings matched across text delta boundaries, for one request.

Life cycle of a request's StopMatcher:
  StopMatcher(stops) --feed(delta)*--> each call returns the text safe to emit now
                                       (a tail that could begin a stop string is held)
                     --a stop matched--> stopped: the text before the stop was returned,
                                         the stop string and anything after it never are
                     --finish()-->       generation ended without a stop (EOS, length):
                                         the held tail is returned, nothing is kept

A stop string may arrive split over any number of deltas, and several stop strings may
share prefixes or overlap. The stop that matches is the one that is complete first in
the text (the earliest end; of two ending together, the longer), so the result does not
depend on how the text was split into deltas. Empty stop strings are ignored (they would
match before any text), duplicates are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class StopCheck:
    """The result of feeding one delta: `text` may be sent to the client now.

    (Not frozen: one or two are made per generated token, and a frozen dataclass takes
    several times as long to construct.)"""

    text: str
    stop: str | None = None  # the stop string that matched, None while none has

    @property
    def stopped(self) -> bool:
        return self.stop is not None


class StopMatcher:
    """Streaming matcher of a fixed set of stop strings over one request's text."""

    __slots__ = ("_firsts", "_held", "_max_held", "_stop", "_stops")

    def __init__(self, stops: Iterable[str]) -> None:
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        # A held tail starts with the first character of some stop string.
        self._firsts = frozenset(s[0] for s in self._stops)
        self._max_held = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self._stop: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings in effect, in the order given, without empties or repeats."""
        return self._stops

    @property
    def held(self) -> str:
        """Text received but not yet returned, because it may begin a stop string."""
        return self._held

    @property
    def stop(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop

    def feed(self, delta: str) -> StopCheck:
        """Add the next text delta; return what may be emitted and whether a stop matched.

        Once a stop has matched, further deltas are discarded: the result is empty text
        with the same `stop`.
        """
        if self._stop is not None:
            return StopCheck("", self._stop)
        if not self._stops:
            return StopCheck(delta)
        text = self._held + delta
        found = self._first_complete_stop(text)
        if found is not None:
            index, stop = found
            self._held = ""
            self._stop = stop
            return StopCheck(text[:index], stop)
        num_held = self._num_tail_held(text)
        self._held = text[len(text) - num_held :]
        return StopCheck(text[: len(text) - num_held])

    def finish(self) -> str:
        """Generation ended without a stop: return the held tail and keep nothing."""
        held, self._held = self._held, ""
        return "" if self._stop is not None else held

    def _first_complete_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop) of the stop occurrence in `text` that ends first (of two ending
        at the same place, the one starting first)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)  # a stop's first start is also its first end
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _num_tail_held(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop.

        Called only when no stop occurs in `text`, so a tail that starts a stop is
        shorter than it: only the last `_max_held` characters need looking at.
        """
        for start in range(max(0, len(text) - self._max_held), len(text)):
            if text[start] in self._firsts:
                tail = text[start:]
                if any(stop.startswith(tail) for stop in self._stops):
                    return len(text) - start
        return 0
