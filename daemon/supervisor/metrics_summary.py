"""The arithmetic behind `lmdctl metrics`: two scrapes of the api's /metrics -> a summary.

The control API (`metrics_collect.py`) scrapes the api's Prometheus text (`api/metrics.py`,
every api process's series added up) twice, a window of `interval` seconds apart. From the two:
- rates = counter delta / seconds between the scrapes. The api adds a request's tokens
  when the request closes, so a window shorter than the requests is bursty: a request
  that ran for 10 s adds all its tokens to the window it ended in.
- p50/p99 of TTFT, TPOT and e2e latency are *estimates* from the histogram buckets, as
  Prometheus' `histogram_quantile` computes them: linear interpolation inside the bucket
  that holds the rank (the answer is never finer than the bucket bounds); a rank in the
  +Inf bucket answers the highest finite bound. The mean (sum / count) is exact. Both
  over the window (bucket deltas) and since the daemon started.
- Series that restarted between the scrapes (a daemon restarted: a counter went down;
  series of their own process, as in tests: their `_created` time changed) count from
  zero: the window is the second scrape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Our key -> the api's histogram (api/metrics.py).
HISTOGRAMS = {
    "ttft": "lmd_time_to_first_token_seconds",
    "tpot": "lmd_time_per_output_token_seconds",
    "e2e": "lmd_e2e_request_latency_seconds",
}
_SCALARS = ("lmd_prompt_tokens_total", "lmd_generation_tokens_total", "lmd_requests_running")
QUANTILES = (0.5, 0.99)
QUANTILE_METHOD = "estimated from histogram buckets (linear interpolation, as Prometheus)"


def bucket_quantile(
    q: float, bounds: tuple[float, ...], cumulative: tuple[float, ...]
) -> float | None:
    """The q-quantile of a histogram given as ascending upper bounds (the last +Inf) and
    cumulative counts; None when it holds no observation."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if not cumulative or cumulative[-1] <= 0:
        return None
    rank = q * cumulative[-1]
    below, lower = 0.0, 0.0
    for upper, count in zip(bounds, cumulative, strict=True):
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower  # the highest finite bound: nothing finer is known
            return lower + (upper - lower) * (rank - below) / (count - below)
        below, lower = count, upper
    return lower


@dataclass(frozen=True, slots=True)
class Histogram:
    bounds: tuple[float, ...]  # upper bounds in seconds, ascending, the last +Inf
    cumulative: tuple[float, ...]  # observations <= each bound
    sum: float  # seconds

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def quantile(self, q: float) -> float | None:
        return bucket_quantile(q, self.bounds, self.cumulative)

    def _check_bounds(self, other: Histogram) -> None:
        if self.bounds != other.bounds:
            raise ValueError("histograms with different buckets cannot be combined")

    def minus(self, earlier: Histogram) -> Histogram:
        self._check_bounds(earlier)
        diff = tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True))
        return Histogram(self.bounds, diff, self.sum - earlier.sum)

    def plus(self, other: Histogram) -> Histogram:
        self._check_bounds(other)
        total = tuple(a + b for a, b in zip(self.cumulative, other.cumulative, strict=True))
        return Histogram(self.bounds, total, self.sum + other.sum)

    def to_json(self) -> dict[str, Any]:
        """{"count", "mean_s", "p50_s", "p99_s"} (None where nothing was observed)."""
        count = round(self.count)
        summary: dict[str, Any] = {"count": count, "mean_s": self.sum / count if count else None}
        for q in QUANTILES:
            summary[f"p{round(q * 100)}_s"] = self.quantile(q)
        return summary


@dataclass(frozen=True, slots=True)
class Scrape:
    """The series `lmdctl metrics` reads from one or more api workers' /metrics."""

    histograms: dict[str, Histogram]  # by our key (HISTOGRAMS)
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    requests: dict[str, float] = field(default_factory=dict)  # by HTTP status
    running: float = 0.0  # requests open in the api (a gauge)
    created: tuple[float, ...] = ()  # each histogram's creation time: changes on restart

    @property
    def num_requests(self) -> float:
        return sum(self.requests.values())

    def restarted_since(self, earlier: Scrape) -> bool:
        """True when this scrape counts from a later start than `earlier` did."""
        if self.created != earlier.created:
            return True
        counters = [
            (self.prompt_tokens, earlier.prompt_tokens),
            (self.generation_tokens, earlier.generation_tokens),
            *((self.requests.get(s, 0.0), n) for s, n in earlier.requests.items()),
            *((self.histograms[k].count, h.count) for k, h in earlier.histograms.items()),
        ]
        return any(now < then for now, then in counters)

    def minus(self, earlier: Scrape) -> Scrape:
        """What happened between `earlier` and this scrape (gauges: this scrape's)."""
        if self.restarted_since(earlier):
            return self
        statuses = self.requests.keys() | earlier.requests.keys()
        return Scrape(
            histograms={k: h.minus(earlier.histograms[k]) for k, h in self.histograms.items()},
            prompt_tokens=self.prompt_tokens - earlier.prompt_tokens,
            generation_tokens=self.generation_tokens - earlier.generation_tokens,
            requests={
                s: self.requests.get(s, 0.0) - earlier.requests.get(s, 0.0) for s in statuses
            },
            running=self.running,
            created=self.created,
        )

    def plus(self, other: Scrape) -> Scrape:
        """Two api workers' scrapes as one."""
        statuses = self.requests.keys() | other.requests.keys()
        return Scrape(
            histograms={k: h.plus(other.histograms[k]) for k, h in self.histograms.items()},
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            generation_tokens=self.generation_tokens + other.generation_tokens,
            requests={s: self.requests.get(s, 0.0) + other.requests.get(s, 0.0) for s in statuses},
            running=self.running + other.running,
            created=self.created + other.created,
        )

    def latency_json(self) -> dict[str, Any]:
        return {k: h.to_json() for k, h in self.histograms.items()}

    def requests_json(self) -> dict[str, int]:
        return {s: round(n) for s, n in sorted(self.requests.items()) if n}


def parse(text: str) -> Scrape:
    """Read the api's /metrics text; ValueError names what is missing."""
    hist_parts: dict[str, dict[str, Any]] = {k: {"buckets": []} for k in HISTOGRAMS}
    by_name = {name: key for key, name in HISTOGRAMS.items()}
    created: dict[str, float] = {}
    values: dict[str, float] = {}
    requests: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            base = s.name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
            base = base.removesuffix("_created")
            if base in by_name:
                part = hist_parts[by_name[base]]
                if s.name.endswith("_bucket"):
                    part["buckets"].append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_sum"):
                    part["sum"] = s.value
                elif s.name.endswith("_created"):
                    created[by_name[base]] = s.value
            elif s.name == "lmd_requests_total":
                status = s.labels.get("status", "?")
                requests[status] = requests.get(status, 0.0) + s.value
            elif s.name in _SCALARS:
                values[s.name] = s.value
    histograms = {}
    for key, part in hist_parts.items():
        if not part["buckets"] or "sum" not in part:
            raise ValueError(f"/metrics has no histogram {HISTOGRAMS[key]}")
        buckets = sorted(part["buckets"])
        histograms[key] = Histogram(
            bounds=tuple(b for b, _ in buckets),
            cumulative=tuple(c for _, c in buckets),
            sum=part["sum"],
        )
    return Scrape(
        histograms=histograms,
        prompt_tokens=values.get("lmd_prompt_tokens_total", 0.0),
        generation_tokens=values.get("lmd_generation_tokens_total", 0.0),
        requests=requests,
        running=values.get("lmd_requests_running", 0.0),
        created=tuple(created.get(k, 0.0) for k in HISTOGRAMS),
    )


def summarize(before: Scrape, after: Scrape, seconds: float) -> dict[str, Any]:
    """The api part of the metrics reply: the window's rates and latencies, and totals."""
    if seconds <= 0:
        raise ValueError(f"the window must last > 0 s, got {seconds}")
    win = after.minus(before)
    return {
        "window": {
            "seconds": round(seconds, 3),
            "generation_tokens_per_s": win.generation_tokens / seconds,
            "prompt_tokens_per_s": win.prompt_tokens / seconds,
            "requests_per_s": win.num_requests / seconds,
            "requests": win.requests_json(),
            "restarted": after.restarted_since(before),
            **win.latency_json(),
        },
        "since_start": {
            "generation_tokens": round(after.generation_tokens),
            "prompt_tokens": round(after.prompt_tokens),
            "requests": after.requests_json(),
            **after.latency_json(),
        },
        "requests_running": round(after.running),
    }
