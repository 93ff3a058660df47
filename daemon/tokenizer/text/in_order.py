"""A request's output tokens put back in order.

In disaggregated mode a request's first token comes from its prefill worker and the
rest from its decode worker, over different sockets: token 1 can reach the tokenizer
before token 0 when the tokenizer is behind. Each token carries its position among the
request's output tokens; `InOrder` holds early ones until the gap is filled.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class InOrder(Generic[T]):
    __slots__ = ("_early", "num_released")

    def __init__(self) -> None:
        self.num_released = 0  # positions 0 .. num_released-1 went out
        self._early: dict[int, T] | None = None  # arrived before an earlier position

    @property
    def num_waiting(self) -> int:
        return len(self._early) if self._early else 0

    def take(self, position: int) -> bool:
        """True (and counted as out) when `position` is the next one and nothing waits:
        the common case, with nothing to hold or allocate."""
        if position == self.num_released and not self._early:
            self.num_released += 1
            return True
        return False

    def arrive(self, position: int, item: T) -> list[T] | None:
        """Items now in order (maybe none yet); None when `position` went out already
        (a duplicate: the caller decides what it means)."""
        if position < self.num_released:
            return None
        if position > self.num_released:
            if self._early is None:
                self._early = {}
            self._early[position] = item
            return []
        ready = [item]
        self.num_released += 1
        while self._early and self.num_released in self._early:
            ready.append(self._early.pop(self.num_released))
            self.num_released += 1
        return ready
