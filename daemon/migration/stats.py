"""Migration counters a prefill worker keeps and sends with its heartbeats.

They reach `lmdctl status --json` (per worker) and the api's /metrics
(lmd_migration_bytes_total, lmd_migration_seconds, lmd_migration_failures_total, one
series per prefill worker; see lmd.api.metrics).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from lmd.stage_times import BUCKETS

# Histogram bucket upper bounds (seconds): from a few blocks over CUDA IPC (tens of
# microseconds) to a long prompt over shared memory on a slow machine; the stages'
# bounds up to 2.5 s.
SECONDS_BUCKETS = BUCKETS[: BUCKETS.index(2.5) + 1]


@dataclass(slots=True)
class MigrationStats:
    count: int = 0  # requests whose KV migrated
    bytes: int = 0
    failures: int = 0  # requests whose migration was refused, failed or timed out
    seconds_sum: float = 0.0
    # Non-cumulative counts per bucket of SECONDS_BUCKETS, plus one for +Inf.
    seconds_counts: list[int] = field(default_factory=lambda: [0] * (len(SECONDS_BUCKETS) + 1))

    def record(self, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.bytes += nbytes
        self.seconds_sum += seconds
        self.seconds_counts[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "bytes": self.bytes,
            "failures": self.failures,
            "seconds_sum": self.seconds_sum,
            "seconds_buckets": list(SECONDS_BUCKETS),
            "seconds_counts": list(self.seconds_counts),
        }
