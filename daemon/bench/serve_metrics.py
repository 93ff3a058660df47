"""What `lmd-bench serve` reports, computed from per-request records (pure, no I/O).

Definitions (as vLLM's and SGLang's serving benchmarks use them):
- TTFT: from sending the request to the first chunk that carries text.
- E2E: from sending the request to the end of its stream.
- TPOT (one value per request with >= 2 output tokens): (E2E - TTFT) / (output tokens - 1).
- ITL: every gap between two consecutive text chunks of a request, pooled over requests (a
  chunk that carries several tokens is one gap, so ITL >= TPOT when servers batch tokens).
- Throughputs divide by the run's duration: first request sent to last stream ended.
- Goodput: completed requests per second that met every given SLO (ttft, tpot, e2e in ms;
  a limit is met when the figure, to the microsecond, is at most the limit).
Percentiles interpolate linearly between the two nearest values (numpy's default).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

SLO_NAMES = ("ttft", "tpot", "e2e")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds of the benchmark's clock."""

    start: float
    expected_input_len: int  # the dataset's figure; `prompt_tokens` from usage wins
    chunk_times: list[float] = field(default_factory=list)  # each text-carrying chunk
    end: float = 0.0
    prompt_tokens: int | None = None  # from the server's usage, when it sent one
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    error: str | None = None  # kind: http_500, stream_error, dropped, timeout, ...
    error_message: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def input_tokens(self) -> int:
        return self.expected_input_len if self.prompt_tokens is None else self.prompt_tokens

    @property
    def output_tokens(self) -> int:
        """From usage; without it, one token per text chunk."""
        return len(self.chunk_times) if self.completion_tokens is None else self.completion_tokens

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of non-empty `values`, linear interpolation."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats_ms(seconds: list[float]) -> dict[str, float | None]:
    """{mean, p50, p90, p99} in milliseconds, rounded to the microsecond; None when empty."""
    if not seconds:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = [s * 1000 for s in seconds]
    out = {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in (50, 90, 99)}}
    return {k: round(v, 3) for k, v in out.items()}


def parse_slos(specs: list[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in SLO_NAMES:
            raise ValueError(f"--goodput {spec!r}: the name must be one of {', '.join(SLO_NAMES)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(
                f"--goodput {spec!r}: expected NAME:MILLISECONDS, e.g. ttft:500"
            ) from None
        if not ms > 0:
            raise ValueError(f"--goodput {spec!r}: the limit must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    # A request that streamed no text has no first token: its TTFT is taken as its E2E.
    ttft = r.ttft if r.ttft is not None else r.e2e
    measured = {"ttft": ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e}
    # At the microsecond, as reported: 180.0000000001 ms meets a 180 ms limit.
    return all(round(measured[name] * 1000, 3) <= limit for name, limit in slos.items())


def summarize(
    results: list[RequestResult], duration: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """The JSON keys other tools read (see docs/benchmarks.md)."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = 1 / duration if duration > 0 else 0.0
    out: dict[str, Any] = {
        "completed": len(done),
        "failed": len(failed),
        "failed_kinds": dict(Counter(r.error for r in failed if r.error)),
        "duration_s": round(duration, 6),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        # Prompt tokens the server's prefix cache served, where it says (else 0).
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in done),
        "request_throughput": round(len(done) * per_s, 4),
        "output_throughput": round(output_tokens * per_s, 4),
        "total_token_throughput": round((input_tokens + output_tokens) * per_s, 4),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in done)
        out["goodput"] = round(good * per_s, 4)
        out["good_requests"] = good
        out["slo_ms"] = slos
    out["ttft_ms"] = stats_ms([t for r in done if (t := r.ttft) is not None])
    out["tpot_ms"] = stats_ms([t for r in done if (t := r.tpot) is not None])
    out["itl_ms"] = stats_ms([gap for r in done for gap in r.itls])
    out["e2e_ms"] = stats_ms([r.e2e for r in done])
    examples: dict[str, str] = {}
    for r in failed:
        if r.error:
            examples.setdefault(r.error, r.error_message[:300])
    out["failed_examples"] = examples
    return out
