"""The requests `lmd-bench plan` simulates: lengths from a distribution or a ShareGPT file,
Poisson arrivals. Seeded: one seed, one workload, whatever the cluster simulated.

Length specs: `512` (fixed), `uniform:LOW:HIGH`, `normal:MEAN:SD`, `lognormal:MEAN:SD` (the
mean and standard deviation of the lengths themselves); draws are rounded and at least 1.

Arrivals: N requests over a window of N / rate seconds, each at a uniform random time in
it. Given its count in a window, a Poisson process's arrival times are exactly that, so
this is a Poisson stream whose offered rate is the requested one, not a noisy estimate.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from lmd.bench import serve_data

KINDS = ("fixed", "uniform", "normal", "lognormal")


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival: float  # seconds from the window's start
    input_len: int  # prompt tokens
    output_len: int  # tokens generated, the first (from prefill) included


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str
    a: float  # fixed: the length; uniform: low; normal, lognormal: mean
    b: float = 0.0  # uniform: high; normal, lognormal: standard deviation

    @classmethod
    def parse(cls, spec: str, flag: str) -> LengthDist:
        """`512`, `uniform:256:768`, ... -> LengthDist; a bad spec is one ValueError line."""
        kind, *values = spec.split(":")
        if not values and kind.isdigit():
            kind, values = "fixed", [kind]
        usage = f"{flag} {spec!r}: expected N, uniform:LO:HI, normal:MEAN:SD or lognormal:MEAN:SD"
        if kind not in KINDS or len(values) != (1 if kind == "fixed" else 2):
            raise ValueError(usage)
        try:
            numbers = [float(v) for v in values]
        except ValueError:
            raise ValueError(usage) from None
        if not all(math.isfinite(v) for v in numbers) or numbers[0] < 1 or min(numbers) < 0:
            raise ValueError(f"{flag} {spec!r}: lengths must be >= 1 and spreads >= 0")
        if kind == "uniform" and numbers[1] < numbers[0]:
            raise ValueError(f"{flag} {spec!r}: HIGH must be >= LOW")
        return cls(kind, *numbers)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:  # lognormal with this mean and sd: sigma^2 = ln(1 + sd^2 / mean^2)
            sigma2 = math.log1p((self.b / self.a) ** 2)
            value = rng.lognormvariate(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))
        return max(1, round(value))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def arrivals(num: int, rate: float, rng: random.Random) -> list[float]:
    """`num` Poisson arrivals at `rate` per second over [0, num / rate)."""
    window = num / rate
    return sorted(rng.random() * window for _ in range(num))


def synthetic(
    num: int, rate: float, input_len: LengthDist, output_len: LengthDist, seed: int
) -> list[SimRequest]:
    rng = random.Random(seed)
    times = arrivals(num, rate, rng)
    return [SimRequest(t, input_len.sample(rng), output_len.sample(rng)) for t in times]


def sharegpt(
    path: Path, num: int, rate: float, *, tokenizer: str | None, seed: int,
    output_len: int | None = None,
) -> list[SimRequest]:  # fmt: skip
    """Lengths from a ShareGPT file, chosen and counted as `lmd-bench serve` does."""
    count = serve_data.token_counter(tokenizer)
    prompts = serve_data.sharegpt_prompts(path, num, output_len, count, seed)
    times = arrivals(num, rate, random.Random(seed))
    return [SimRequest(t, p.input_len, p.output_len) for t, p in zip(times, prompts, strict=True)]
