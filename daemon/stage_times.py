"""Where a request's time goes, stage by stage, in every worker (issue: served throughput).

Each worker keeps a `StageTimes`: per stage, how many times it was observed, the seconds
summed and a histogram. Workers report it in their heartbeats (status `stages`); the
api's `/metrics` shows every worker's as `lmd_stage_seconds{stage, worker}`, and
`lmd-bench serve` reads it before and after a run to print the run's breakdown.

The stages, in a request's order (disaggregated; hybrid has no reserve or migration):
  api          api:       HTTP request in -> TextRequest sent (parse, check, admit)
  tokenizer    tokenizer: TextRequest sent -> Generate sent (the way there, its inbox,
                          template, tokenize, route)
  queue        engine:    Generate sent -> start of the step that samples its first token
                          (the way there, waiting for a step; a long prompt's first chunks)
  prefill      engine:    that step
  reserve      prefill:   Generate sent -> decode's Reserved applied
  migration    prefill:   first token sampled -> Migrated sent (the KV copy's wait)
  step         engine:    every step (a decode token's time is one step)
  to_tokenizer tokenizer: Tokens sent -> handled (the way there, its inbox)
  detokenize   tokenizer: Tokens handled -> their text sent in a TextDelta
  to_api       api:       TextDelta sent -> handled
  sse_write    api:       a stream's delta handled -> written to the client
Per-token stages (step on) count messages and writes, not tokens: one Tokens message
carries a step's tokens for one tokenizer. Spans between processes are wall-clock
differences (`time.time()`, stamped in the message as `sent_at`): exact on one host,
off by the clock skew between cluster nodes (negative ones are not counted).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import OrderedDict
from typing import Any

STAGES = (
    "api",
    "tokenizer",
    "queue",
    "prefill",
    "reserve",
    "migration",
    "step",
    "to_tokenizer",
    "detokenize",
    "to_api",
    "sse_write",
)
# Seconds: from a ZeroMQ hop (~50 us) to a prompt queued behind a long backlog.
BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
MAX_SPAN_S = 3600.0  # a span longer than this is a stamp from a skewed clock, not a wait


class StageTimes:
    """Seconds per stage: count, sum and a histogram over BUCKETS (+Inf last)."""

    __slots__ = ("_counts", "_num", "_sums")

    def __init__(self) -> None:
        self._num: dict[str, int] = {}
        self._sums: dict[str, float] = {}
        self._counts: dict[str, list[int]] = {}

    def observe(self, stage: str, seconds: float) -> None:
        if not 0.0 <= seconds <= MAX_SPAN_S:
            return
        counts = self._counts.get(stage)
        if counts is None:
            counts = self._counts[stage] = [0] * (len(BUCKETS) + 1)
            self._num[stage], self._sums[stage] = 0, 0.0
        counts[bisect_left(BUCKETS, seconds)] += 1
        self._num[stage] += 1
        self._sums[stage] += seconds

    def since(self, stage: str, sent_at: float) -> None:
        """A span that began at `sent_at` (time.time() in another process) ends now;
        messages built without a stamp (0) are not counted."""
        if sent_at > 0.0:
            self.observe(stage, time.time() - sent_at)

    def count(self, stage: str) -> int:
        return self._num.get(stage, 0)

    def to_dict(self) -> dict[str, Any]:
        """{stage: {"count", "sum_s", "buckets": per-bucket counts, +Inf last}}."""
        sums, counts = self._sums, self._counts
        return {
            stage: {"count": n, "sum_s": round(sums[stage], 6), "buckets": counts[stage]}
            for stage, n in self._num.items()
        }


MAX_TRACKED = 4096  # requests that never reach their last stage are forgotten, oldest first


class StageClock:
    """Per-request laps into a StageTimes: `start` at a request's first stamp, `lap` at
    each stage it passes (the time since the last mark counts for that stage), `stop` at
    its last. Bounded: a request that never stops is forgotten after MAX_TRACKED others."""

    __slots__ = ("_marks", "times")

    def __init__(self, times: StageTimes) -> None:
        self.times = times
        self._marks: OrderedDict[str, float] = OrderedDict()  # request id -> last mark

    def start(self, request_id: str, at: float) -> None:
        """`at`: time.time() of the request's first stamp (0: not stamped, not timed)."""
        if at <= 0.0:
            return
        self._marks[request_id] = at
        if len(self._marks) > MAX_TRACKED:
            self._marks.popitem(last=False)

    def lap(self, request_id: str, stage: str, now: float) -> None:
        mark = self._marks.get(request_id)
        if mark is None:
            return
        self.times.observe(stage, now - mark)
        self._marks[request_id] = now

    def stop(self, request_id: str, stage: str, now: float) -> None:
        """The last lap: the request is forgotten."""
        self.lap(request_id, stage, now)
        self._marks.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._marks.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._marks)
