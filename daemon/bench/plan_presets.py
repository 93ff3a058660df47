"""Where `lmd-bench plan` gets a worker profile: a preset built from our own measurements, a
JSON file (plan_profile.py's schema), or `lmd-bench offline --json` runs.

Every preset figure names its source (docs/benchmarks.md unless said otherwise); figures
that are estimates, not measurements, say so. Override any of them with a file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson

from lmd.bench.plan_profile import WorkerProfile, kv_bytes_per_token, profile_from_json

LLAMA3_8B_KV = kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)  # 128 KiB
SMOLLM2_FP32_KV = kv_bytes_per_token(layers=30, kv_heads=3, head_dim=64, dtype_bytes=4)  # 45 KiB
OFFLINE_KEYS = ("batch", "input_len", "output_len", "seconds")  # what a profile needs of a run

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b-h100": {
        "name": "llama3-8b-h100",
        "notes": "Llama-3-8B shape, bf16, turbo backend, one H100 80GB (2026-11-22)",
        "prefill": {
            # 1 token: a batch-1 engine step (below). 1,600: TTFT mean of ~1,600-token prompts
            # at concurrency 1, hybrid, torch backend (docs/benchmarks.md, 'Disaggregated
            # serving', H100, 2026-11-22). 8,192: one 16 x 512 chunk, turbo, GPU time from
            # the torch profiler ('Run 3: measured', H100, 2026-11-22).
            "tokens": [1, 1600, 8192],
            "step_ms": [7.1, 57.3, 180.0],
            "max_tokens": 8192,
        },
        "decode": {
            # Engine steps from `lmd-bench offline --input-len 512 --output-len 256`, the run's
            # time less its prefill over 255 steps: batch 1 from turbo run 2's tok/s less an
            # estimated prefill, batch 64 from run 3's tok/s less 4 prefill chunks (the 8,192
            # point above), batch 512 from run 3's decode time a step (docs/benchmarks.md,
            # 'Run 2: measured' and 'Run 3: measured', H100, 2026-11-22; the arithmetic is in
            # 'Figures that code comments used to quote'). Context 512-768, 640 on average.
            "batch_sizes": [1, 64, 512],
            "step_ms": [7.1, 10.4, 32.9],
            "context_len": 640,
            # KV read rate: that H100's device-to-device copy rate (docs/benchmarks.md,
            # 'turbo backend', H100, 2026-11-22).
            "kv_read_gbytes_s": 3000,
        },
        "max_batch": 512,  # the largest CUDA-graph bucket and batch measured
        # Estimate: 0.8 (cache_max_entry_count) x (80 GB - 16.06 GB of weights - ~4 GB of
        # activations and graphs) / 128 KiB per token.
        "kv_capacity_tokens": int(0.8 * (80e9 - 16.06e9 - 4e9) / LLAMA3_8B_KV),
        "kv_bytes_per_token": LLAMA3_8B_KV,
        # Assumed, not measured: one 400 Gb/s NIC per GPU (ConnectX-7 class, as in HGX H100
        # nodes). Over NVLink in one node cuda_ipc moved several times that (docs/benchmarks.md,
        # 'KV transfer' and 'Disaggregated serving', 2x H200, 2026-11-22).
        "migration_gbps": 400,
        # Measured: what disaggregation added to TTFT over hybrid on one H100 (reserve round
        # trip, Migrated, decode's first send; the copy itself a small part of it):
        # docs/benchmarks.md, 'Disaggregated serving', H100, 2026-11-22.
        "migration_latency_ms": 2.0,
    },
    "smollm2-cpu": {
        "name": "smollm2-cpu",
        "notes": "SmolLM2-135M-Instruct, fp32, torch backend, the 2-core dev machine",
        "prefill": {
            # 1 token: a batch-1 decode step (below). 1,024: `lmd-bench offline --batch 8
            # --input-len 128 --output-len 1` (prefill only; docs/benchmarks.md, 'Engine,
            # offline', 'CPU: 2 cores, 24 GiB, no GPU', 2026-11-22).
            "tokens": [1, 1024],
            "step_ms": [46.2, 2560.0],
        },
        "decode": {
            # Batch 1: TPOT p50 of `lmd-bench serve` c1 (docs/benchmarks.md, 'Serving, end to
            # end', 'CPU: 2 cores, 24 GiB, no GPU', 2026-11-22); batch 8: the batch-8 decode
            # step of `lmd-bench offline`, 128 in / 64 out ('Engine, offline', same machine
            # and date). Shared cores: runs differ widely (the spread is in those sections).
            "batch_sizes": [1, 8],
            "step_ms": [46.2, 81.0],
        },
        "max_batch": 8,  # the largest batch measured
        "kv_capacity_tokens": int(1.6 * 2**30 / SMOLLM2_FP32_KV),  # 1.6 GiB per engine (README)
        "kv_bytes_per_token": SMOLLM2_FP32_KV,
        # Measured: a 2.9 MB migration through the host transport, the middle of its range
        # (docs/benchmarks.md, 'Disaggregated serving', CPU, 2 cores, 2026-11-22).
        "migration_gbps": 5.3 * 8,
        "migration_latency_ms": 0.0,
    },
}


def load_profile(spec: str) -> dict[str, Any]:
    """A preset's name or a JSON file's path -> the profile as JSON (not yet validated)."""
    if spec in PRESETS:
        return dict(PRESETS[spec])
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"--profile {spec}: neither a preset ({', '.join(PRESETS)}) nor a JSON file"
        )
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"--profile {spec}: cannot read a JSON file: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"--profile {spec}: expected one JSON object")
    return data


def _offline_runs(paths: list[Path]) -> list[dict[str, Any]]:
    runs = []
    for path in paths:
        try:
            run = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ValueError(f"--offline {path}: cannot read a JSON file: {exc}") from exc
        if not isinstance(run, dict) or run.get("benchmark") != "offline":
            raise ValueError(f"--offline {path}: not the JSON of `lmd-bench offline --out`")
        if not all(isinstance(run.get(k), int | float) and run[k] > 0 for k in OFFLINE_KEYS):
            raise ValueError(f"--offline {path}: needs positive {', '.join(OFFLINE_KEYS)}")
        runs.append(run)
    return runs


def _mean_by(pairs: list[tuple[float, float]]) -> dict[float, float]:
    """x -> the mean of its y values, sorted by x (runs repeated at one size average)."""
    groups: dict[float, list[float]] = {}
    for x, y in pairs:
        groups.setdefault(x, []).append(y)
    return {x: sum(groups[x]) / len(groups[x]) for x in sorted(groups)}


def _prefill_ms(profile: WorkerProfile, prompt_tokens: int) -> float:
    """A batch of prompts all at once: full chunks of max_tokens, then the rest."""
    full, rest = divmod(prompt_tokens, profile.max_prefill_tokens)
    ms = full * profile.prefill_step_ms(profile.max_prefill_tokens)
    return ms + (profile.prefill_step_ms(rest) if rest else 0.0)


def with_offline_runs(base: dict[str, Any], paths: list[Path]) -> dict[str, Any]:
    """`base` with its prefill and decode tables replaced by what offline runs measured.

    A run with --output-len 1 is a prefill point: batch x input_len prompt tokens in
    ceil(that / max_tokens) equal steps. A longer run is a decode point: its time less the
    prefill of its prompts (from the prefill table, measured or the base's), over
    output_len - 1 steps at --batch, at the run's mean context.
    """
    runs = _offline_runs(paths)
    out = dict(base)
    max_tokens = int((base.get("prefill") or {}).get("max_tokens", 8192))
    measured = []
    for run in (r for r in runs if r["output_len"] == 1):
        total = run["batch"] * run["input_len"]
        steps = math.ceil(total / max_tokens)
        measured.append((total / steps, run["seconds"] * 1e3 / steps))
    points = _mean_by(measured)
    if len(points) == 1:  # one point: a rate, through the origin
        ((tokens, ms),) = points.items()
        out["prefill"] = {"tokens_per_s": tokens / ms * 1e3, "max_tokens": max_tokens}
    elif points:
        out["prefill"] = {"tokens": list(points), "step_ms": list(points.values()),
                          "max_tokens": max_tokens}  # fmt: skip
    decode_runs = [r for r in runs if r["output_len"] > 1]
    if decode_runs:
        profile = profile_from_json(out, "profile")
        steps_ms = []
        for run in decode_runs:
            prefill_ms = _prefill_ms(profile, run["batch"] * run["input_len"])
            step = (run["seconds"] * 1e3 - prefill_ms) / (run["output_len"] - 1)
            if step <= 0:
                raise ValueError(
                    f"--offline: batch {run['batch']} ran faster than its prefill alone: "
                    "measure the prefill (--output-len 1) on the same machine"
                )
            steps_ms.append((run["batch"], step))
        table = _mean_by(steps_ms)
        out["decode"] = {
            "batch_sizes": list(table),
            "step_ms": [round(v, 3) for v in table.values()],
        }
        if "kv_read_gbytes_s" in (base.get("decode") or {}):
            run = decode_runs[0]
            out["decode"] |= {"context_len": run["input_len"] + run["output_len"] // 2,
                              "kv_read_gbytes_s": base["decode"]["kv_read_gbytes_s"]}  # fmt: skip
        out["max_batch"] = int(max(table))
    out["name"] = f"{base.get('name', 'profile')} + offline runs"
    return out
