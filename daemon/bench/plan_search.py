"""The search of `lmd-bench plan`: the fewest GPUs that meet the SLOs (pure, no I/O).

A configuration meets the target when at least `attainment` of the requests meet every
SLO (serve_metrics.meets_slos, as `lmd-bench serve --goodput` counts them); goodput is
serve_metrics' figure over the arrival window (requests meeting the SLOs per second of
offered load, so the last requests' drain does not count against a finite run).

Disaggregated: the cheapest (P, D) walks the frontier. Throughput gives lower bounds (a
worker cannot compute more prompt or output tokens per second than its profile allows);
for the first P the smallest D is found by galloping + bisection, for each further P the
frontier only moves down, and the walk stops once P + D_min cannot beat the best. The
galloping over D for one P stops early when TTFT alone misses the target and more decode
workers do not help it (more_decode_cannot_help). Both searches assume more workers never
hurt (the tests check that the simulation agrees).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmd.bench.plan_profile import WorkerProfile
from lmd.bench.plan_sim import SimResult, simulate_disaggregated, simulate_hybrid
from lmd.bench.plan_workload import SimRequest
from lmd.bench.serve_metrics import RequestResult, meets_slos, summarize

DISAGGREGATED, HYBRID = "disaggregated", "hybrid"


@dataclass(frozen=True, slots=True)
class Target:
    slos: dict[str, float]  # serve_metrics names -> milliseconds
    attainment: float  # fraction of requests that must meet every SLO
    max_gpus: int


@dataclass(frozen=True, slots=True)
class Candidate:
    mode: str
    prefill: int  # hybrid: the number of hybrid workers
    decode: int  # hybrid: 0
    feasible: bool
    metrics: dict[str, Any]

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode

    @property
    def label(self) -> str:
        return f"{self.prefill}H" if self.mode == HYBRID else f"{self.prefill}P+{self.decode}D"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "config": self.label, "prefill_workers": self.prefill,
                "decode_workers": self.decode, "gpus": self.gpus, "meets_target": self.feasible,
                **self.metrics}  # fmt: skip


def measure(
    requests: Sequence[SimRequest], result: SimResult, window: float, slos: dict[str, float]
) -> dict[str, Any]:
    """serve_metrics' summary of a simulated run, plus the SLO attainment."""
    records = []
    for r, first, end in zip(requests, result.first_token, result.end, strict=True):
        chunks = [first] if r.output_len == 1 else [first, end]
        record = RequestResult(r.arrival, r.input_len, chunks, end, completion_tokens=r.output_len)
        records.append(record)
    summary = summarize(records, window, slos)
    good = summary.get("good_requests", len(records))
    ttft_good = None
    if "ttft" in slos:
        ttft_good = sum(meets_slos(r, {"ttft": slos["ttft"]}) for r in records)
    return {
        "goodput": summary.get("goodput", summary["request_throughput"]),
        "good_requests": good,
        "slo_attainment": round(good / len(records), 4),
        "ttft_attainment": None if ttft_good is None else round(ttft_good / len(records), 4),
        "num_waited_for_kv": result.num_waited,
        "request_rate": summary["request_throughput"],
        "output_throughput": summary["output_throughput"],
        "ttft_ms": summary["ttft_ms"],
        "tpot_ms": summary["tpot_ms"],
        "e2e_ms": summary["e2e_ms"],
        "utilisation": {k: round(v, 4) for k, v in result.utilisation.items()},
    }


class Planner:
    """Simulates configurations of one workload (same requests each time), remembering each."""

    def __init__(
        self, profile: WorkerProfile, requests: Sequence[SimRequest], window: float,
        target: Target,
    ) -> None:  # fmt: skip
        if not requests:
            raise ValueError("no requests to simulate")
        self.profile, self.requests, self.window, self.target = profile, requests, window, target
        self.tried: dict[tuple[str, int, int], Candidate] = {}

    def evaluate(self, mode: str, prefill: int, decode: int = 0) -> Candidate:
        key = (mode, prefill, decode)
        if key not in self.tried:
            if mode == HYBRID:
                result = simulate_hybrid(self.profile, self.requests, prefill)
            else:
                result = simulate_disaggregated(self.profile, self.requests, prefill, decode)
            metrics = measure(self.requests, result, self.window, self.target.slos)
            needed = math.ceil(self.target.attainment * len(self.requests) - 1e-9)
            feasible = metrics["good_requests"] >= needed
            self.tried[key] = Candidate(mode, prefill, decode, feasible, metrics)
        return self.tried[key]

    def more_decode_cannot_help(self, found: Candidate, before: Candidate | None) -> bool:
        """TTFT alone misses the target and more decode workers cannot move it: with no
        reservation held back, the prefill timeline (so every TTFT) is the same for any D;
        otherwise a larger D that left the TTFT attainment no better is taken as the sign."""
        ttft = found.metrics["ttft_attainment"]
        if ttft is None or ttft >= self.target.attainment:
            return False
        if found.metrics["num_waited_for_kv"] == 0:
            return True
        return before is not None and 0 < ttft <= before.metrics["ttft_attainment"]

    def lower_bounds(self) -> dict[str, int]:
        """Workers needed for the offered tokens per second alone (utilisation < 1)."""
        rate = len(self.requests) / self.window
        prompt = rate * sum(r.input_len for r in self.requests) / len(self.requests)
        output = rate * sum(r.output_len - 1 for r in self.requests) / len(self.requests)
        p = prompt / self.profile.prefill_tokens_per_s
        d = output / self.profile.decode_tokens_per_s
        return {"prefill": max(1, math.ceil(p)), "decode": max(1, math.ceil(d)),
                "hybrid": max(1, math.ceil(p + d))}  # fmt: skip

    def best_disaggregated(self) -> Candidate | None:
        """The fewest GPUs (then the highest goodput) among P prefill + D decode workers."""
        bounds, cap = self.lower_bounds(), self.target.max_gpus
        low_d = bounds["decode"]
        best: Candidate | None = None
        d_min: int | None = None  # the smallest feasible D of the previous P
        p = bounds["prefill"]
        while p + low_d <= cap and (best is None or p + low_d < best.gpus):
            if d_min is None:
                d_min = smallest(low_d, cap - p, functools.partial(self._pd, p),
                                 self.more_decode_cannot_help)  # fmt: skip
            else:  # feasible at d_min with fewer prefill workers: try lower
                while d_min > low_d and self.evaluate(DISAGGREGATED, p, d_min - 1).feasible:
                    d_min -= 1
            # (p, d_min) unsimulated: d_min - 1 failed, so it costs more than (p - 1, d_min).
            found = self.tried.get((DISAGGREGATED, p, d_min or 0))
            if found is not None and found.feasible and (best is None or _better(found, best)):
                best = found
            if d_min == low_d:
                break  # more prefill workers cannot lower the count
            p += 1
        return best

    def _pd(self, prefill: int, decode: int) -> Candidate:
        return self.evaluate(DISAGGREGATED, prefill, decode)

    def best_hybrid(self) -> Candidate | None:
        low = self.lower_bounds()["hybrid"]
        workers = smallest(low, self.target.max_gpus, lambda h: self.evaluate(HYBRID, h))
        return None if workers is None else self.evaluate(HYBRID, workers)

    def candidates(self) -> list[Candidate]:
        """Everything simulated, hybrid last, by GPU count then prefill workers."""
        return sorted(self.tried.values(), key=lambda c: (c.mode == HYBRID, c.gpus, c.prefill))


def _better(a: Candidate, b: Candidate) -> bool:
    return (a.gpus, -a.metrics["goodput"]) < (b.gpus, -b.metrics["goodput"])


def smallest(
    low: int, high: int, evaluate: Callable[[int], Candidate],
    give_up: Callable[[Candidate, Candidate | None], bool] | None = None,
) -> int | None:  # fmt: skip
    """The smallest n in [low, high] whose candidate is feasible, feasibility being
    monotone in n: galloping up from low (low, low+1, low+3, ...), then bisection. None
    when none is, or when give_up(candidate, the one before) says more n cannot help."""
    bad, n, step = low - 1, low, 1
    if low > high:
        return None
    before = None
    while not (found := evaluate(n)).feasible:
        if n >= high or (give_up is not None and give_up(found, before)):
            return None
        bad, n, step, before = n, min(high, n + step), step * 2, found
    while n - bad > 1:
        mid = (n + bad) // 2
        if evaluate(mid).feasible:
            n = mid
        else:
            bad = mid
    return n
