"""Where a request's time to first token goes inside an engine worker.

An engine worker starts a request's clock when its Generate arrives and takes a lap at
each stage it passes (prefill: the reservation granted, then the first token; hybrid:
the first token). Mean milliseconds per stage go out with the heartbeats, so
`lmdctl status --json` shows them per worker ("stages_ms"): what is needed to see why
disaggregated TTFT is above hybrid's on a given machine.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

MAX_TRACKED = 4096  # requests that never reach their last stage are forgotten, oldest first


class StageClock:
    def __init__(self) -> None:
        self._marks: OrderedDict[str, float] = OrderedDict()  # request id -> last mark
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def start(self, request_id: str, now: float | None = None) -> None:
        self._marks[request_id] = time.monotonic() if now is None else now
        if len(self._marks) > MAX_TRACKED:
            self._marks.popitem(last=False)

    def lap(self, request_id: str, stage: str, now: float | None = None) -> None:
        """Time since the last mark counts for `stage`; the clock goes on."""
        mark = self._marks.get(request_id)
        if mark is None:
            return
        now = time.monotonic() if now is None else now
        self._sums[stage] = self._sums.get(stage, 0.0) + (now - mark)
        self._counts[stage] = self._counts.get(stage, 0) + 1
        self._marks[request_id] = now

    def stop(self, request_id: str, stage: str, now: float | None = None) -> None:
        """The last lap: the request is forgotten."""
        self.lap(request_id, stage, now)
        self._marks.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._marks.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._marks)

    def to_dict(self) -> dict[str, Any]:
        return {
            stage: {"count": n, "mean_ms": round(1000 * self._sums[stage] / n, 3)}
            for stage, n in self._counts.items()
        }
