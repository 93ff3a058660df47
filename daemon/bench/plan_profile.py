"""A worker profile for `lmd-bench plan`: what one GPU's engine does per step (pure, no I/O
beyond reading the file it is given).

The JSON schema (a file, or a preset of plan_presets.py; unknown keys are an error):

    {
      "name": "my-gpu",                          optional label
      "prefill": {                               one prefill step (chunks packed up to max_tokens)
        "tokens": [1, 1600, 8192],               tokens in the step ...
        "step_ms": [7.2, 57.3, 180.0],           ... and its time, interpolated linearly
        "max_tokens": 8192                       max_prefill_token_num (default 8192)
      },                                         or {"tokens_per_s": X, "overhead_ms": Y}
      "decode": {                                one decode step over the running batch
        "batch_sizes": [1, 64, 512],
        "step_ms": [7.2, 10.4, 33.0],            measured at context_len tokens per sequence
        "context_len": 512,                      optional, with kv_read_gbytes_s: each token of
        "kv_read_gbytes_s": 3000                 context beyond it adds kv_bytes_per_token / that
      },
      "max_batch": 512,                          decode batch cap (default: the largest batch)
      "kv_capacity_tokens": 366000,              KV pool per worker, tokens (default: no limit)
      "kv_bytes_per_token": 131072,              2 * layers * kv_heads * head_dim * dtype bytes
      "migration_gbps": 400,                     prefill -> decode link, gigabits per second
      "migration_latency_ms": 2.0                fixed cost per migration (reserve, messages)
    }

Between two measured points the step time is linear; past the last one it follows the last
segment's slope (never down); below the first it is the first point's time.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_PREFILL_TOKENS = 8192  # lmd's max_prefill_token_num default (engine/config.py)
TOP_KEYS = {
    "name", "prefill", "decode", "max_batch", "kv_capacity_tokens", "kv_bytes_per_token",
    "migration_gbps", "migration_latency_ms", "notes",
}  # fmt: skip
PREFILL_KEYS = {"tokens", "step_ms", "max_tokens", "tokens_per_s", "overhead_ms"}
DECODE_KEYS = {"batch_sizes", "step_ms", "context_len", "kv_read_gbytes_s"}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of every layer for one token."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear through (xs, ys); flat below xs[0], the last slope (>= 0) above."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[-1]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    slope = (y1 - y0) / (x1 - x0)
    if x > x1:
        slope = max(slope, 0.0)
    return y0 + slope * (x - x0)


@dataclass(frozen=True, slots=True)
class WorkerProfile:
    """One GPU's engine, as the simulation sees it; times in milliseconds."""

    name: str
    prefill_tokens: tuple[float, ...]
    prefill_ms: tuple[float, ...]
    decode_batch: tuple[float, ...]
    decode_ms: tuple[float, ...]
    max_prefill_tokens: int
    max_batch: int
    kv_capacity_tokens: int | None
    kv_bytes_per_token: int
    migration_gbps: float
    migration_latency_ms: float = 0.0
    decode_context_len: int = 0
    kv_read_gbytes_s: float | None = None

    def __post_init__(self) -> None:
        for batch in (*self.decode_batch, self.max_batch):
            floor = self.decode_step_ms(int(batch), 0)
            if floor <= 0:
                raise ValueError(
                    f"profile {self.name}: decode.step_ms at batch {batch:g} is below the time "
                    "to read its context_len of KV at kv_read_gbytes_s: check both"
                )

    def prefill_step_ms(self, tokens: int) -> float:
        return interpolate(self.prefill_tokens, self.prefill_ms, tokens)

    @property
    def ms_per_context_token(self) -> float:
        """Decode: time to read one token's KV (0 without kv_read_gbytes_s)."""
        if not self.kv_read_gbytes_s:
            return 0.0
        return self.kv_bytes_per_token / (self.kv_read_gbytes_s * 1e9) * 1e3

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        """One step of `batch` sequences holding `context_tokens` of KV in all."""
        measured = interpolate(self.decode_batch, self.decode_ms, batch)
        extra = context_tokens - batch * self.decode_context_len
        return measured + self.ms_per_context_token * extra

    def migration_s(self, tokens: int) -> float:
        """Seconds the link is busy moving `tokens` of KV (the fixed latency is apart)."""
        return tokens * self.kv_bytes_per_token * 8 / (self.migration_gbps * 1e9)

    @property
    def prefill_tokens_per_s(self) -> float:
        """The most prompt tokens per second one worker can compute (full steps)."""
        sizes = [t for t in self.prefill_tokens if t <= self.max_prefill_tokens]
        sizes.append(self.max_prefill_tokens)
        return max(t / self.prefill_step_ms(int(t)) for t in sizes) * 1e3

    @property
    def decode_tokens_per_s(self) -> float:
        """The most output tokens per second one worker can decode (at no context: a bound)."""
        sizes = [b for b in self.decode_batch if b <= self.max_batch]
        sizes.append(self.max_batch)
        return max(b / self.decode_step_ms(int(b), 0) for b in sizes) * 1e3

    def to_json(self) -> dict[str, Any]:
        """The profile in the file schema (what --json records)."""
        decode: dict[str, Any] = {"batch_sizes": list(self.decode_batch),
                                  "step_ms": list(self.decode_ms)}  # fmt: skip
        if self.kv_read_gbytes_s:
            decode |= {"context_len": self.decode_context_len,
                       "kv_read_gbytes_s": self.kv_read_gbytes_s}  # fmt: skip
        prefill = {"tokens": list(self.prefill_tokens), "step_ms": list(self.prefill_ms),
                   "max_tokens": self.max_prefill_tokens}  # fmt: skip
        return {
            "name": self.name,
            "prefill": prefill,
            "decode": decode,
            "max_batch": self.max_batch,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "migration_gbps": self.migration_gbps,
            "migration_latency_ms": self.migration_latency_ms,
        }


def _table(section: dict[str, Any], xkey: str, where: str) -> tuple[tuple[float, ...], ...]:
    xs, ys = section.get(xkey), section.get("step_ms")
    if not (isinstance(xs, list) and isinstance(ys, list) and xs and len(xs) == len(ys)):
        raise ValueError(f"{where}: {xkey} and step_ms must be lists of the same length >= 1")
    if not all(_positive(v) for v in (*xs, *ys)):
        raise ValueError(f"{where}: {xkey} and step_ms must be positive numbers")
    if any(b <= a for a, b in itertools.pairwise(xs)):
        raise ValueError(f"{where}: {xkey} must increase")
    return tuple(float(x) for x in xs), tuple(float(y) for y in ys)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


REQUIRED: Any = object()


def _number(data: dict[str, Any], key: str, where: str, default: Any = REQUIRED) -> Any:
    """data[key] (> 0; 0 allowed where the default is 0), else the default."""
    if key not in data:
        if default is REQUIRED:
            raise ValueError(f"{where}: {key} is required")
        return default
    value = data[key]
    if not (_positive(value) or (value == 0 and default == 0 and not isinstance(value, bool))):
        raise ValueError(f"{where}: {key} must be a positive number, not {value!r}")
    return value


def _unknown(data: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(data) - allowed)
    if extra:
        raise ValueError(f"{where}: unknown key {extra[0]!r} (known: {', '.join(sorted(allowed))})")


def _prefill(data: Any, where: str) -> tuple[tuple[float, ...], tuple[float, ...], int]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: prefill must be an object")
    _unknown(data, PREFILL_KEYS, f"{where}: prefill")
    max_tokens = int(_number(data, "max_tokens", f"{where}: prefill", DEFAULT_MAX_PREFILL_TOKENS))
    if "tokens_per_s" in data:  # a straight line through two points is exact
        rate = _number(data, "tokens_per_s", f"{where}: prefill")
        overhead = _number(data, "overhead_ms", f"{where}: prefill", 0.0)
        ends = (1.0, float(max(max_tokens, 2)))
        return ends, tuple(overhead + x * 1e3 / rate for x in ends), max_tokens
    xs, ys = _table(data, "tokens", f"{where}: prefill")
    if len(xs) < 2:
        raise ValueError(f"{where}: prefill needs two points or tokens_per_s")
    return xs, ys, max_tokens


def profile_from_json(data: Any, where: str = "profile") -> WorkerProfile:
    """A validated profile; every problem is one ValueError line naming the key."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    _unknown(data, TOP_KEYS, where)
    p_tokens, p_ms, max_tokens = _prefill(data.get("prefill"), where)
    decode = data.get("decode")
    if not isinstance(decode, dict):
        raise ValueError(f"{where}: decode must be an object")
    _unknown(decode, DECODE_KEYS, f"{where}: decode")
    d_batch, d_ms = _table(decode, "batch_sizes", f"{where}: decode")
    read = _number(decode, "kv_read_gbytes_s", f"{where}: decode", None)
    if read is not None and "context_len" not in decode:
        raise ValueError(f"{where}: decode.kv_read_gbytes_s needs decode.context_len")
    capacity = _number(data, "kv_capacity_tokens", where, None)
    return WorkerProfile(
        name=str(data.get("name", where)),
        prefill_tokens=p_tokens,
        prefill_ms=p_ms,
        decode_batch=d_batch,
        decode_ms=d_ms,
        max_prefill_tokens=max_tokens,
        max_batch=int(_number(data, "max_batch", where, d_batch[-1])),
        kv_capacity_tokens=None if capacity is None else int(capacity),
        kv_bytes_per_token=int(_number(data, "kv_bytes_per_token", where)),
        migration_gbps=float(_number(data, "migration_gbps", where)),
        migration_latency_ms=float(_number(data, "migration_latency_ms", where, 0.0)),
        decode_context_len=int(_number(decode, "context_len", f"{where}: decode", 0)),
        kv_read_gbytes_s=None if read is None else float(read),
    )
