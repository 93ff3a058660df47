"""`lmd-bench compare a.json b.json ...`: runs side by side.

    lmd-bench compare before.json after.json [--metrics output_throughput,ttft_ms.p99]
        [--plot compare.png]

Reads what any `lmd-bench` subcommand wrote with --out (or printed with --json). Every
number in a file is a metric, named by its path (`ttft_ms.p99`); the serving figures come
first, in a fixed order. Each value after the first run's shows its ratio to the first run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson

from lmd.bench.serve_plot import plot_bars, require_matplotlib

LATENCIES = [
    f"{m}_ms.{q}" for m in ("ttft", "tpot", "itl", "e2e") for q in ("mean", "p50", "p90", "p99")
]
# The serving figures, in the order people read them.
FIRST = [
    "completed", "failed", "duration_s", "request_throughput", "output_throughput",
    "total_token_throughput", "goodput", *LATENCIES,
]  # fmt: skip
PLOTTED = [
    "request_throughput", "output_throughput", "goodput", "ttft_ms.p50", "ttft_ms.p99",
    "tpot_ms.p50", "tpot_ms.p99", "itl_ms.p50", "itl_ms.p99", "e2e_ms.p50", "e2e_ms.p99",
]  # fmt: skip
SKIPPED = ("environment",)  # where and with what it ran: not a figure to compare
MAX_PLOTTED = 12
RUN_KEYS = ("benchmark", "command", "date")  # what each run says about itself


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="several runs' JSON side by side (table, bar chart)")
    p.add_argument("files", nargs="+", type=Path, help="JSON written by lmd-bench ... --out")
    p.add_argument("--metrics", help="comma-separated names to show, e.g. ttft_ms.p99")
    p.add_argument("--plot", type=Path, help="PNG: one bar chart per metric")
    p.set_defaults(run=run)


def flatten(obj: Any, prefix: str = "") -> dict[str, float | None]:
    """The numbers (and nulls) in a JSON object by dotted path; booleans, strings and
    lists are not metrics."""
    out: dict[str, float | None] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not prefix and key in SKIPPED:
                continue
            out |= flatten(value, f"{prefix}{key}.")
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        out[prefix.rstrip(".")] = float(obj)
    elif obj is None and prefix:
        out[prefix.rstrip(".")] = None  # e.g. no TTFT when every request failed
    return out


def _load(path: Path) -> dict[str, Any]:
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected one JSON object, as lmd-bench --out writes")
    return data


def _labels(runs: list[dict[str, Any]], files: list[Path]) -> list[str]:
    labels: list[str] = []
    for data, path in zip(runs, files, strict=True):
        label = str(data.get("label") or path.stem)
        labels.append(label if label not in labels else f"{label} ({len(labels) + 1})")
    return labels


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.plot is not None:
        require_matplotlib()
    runs = [_load(path) for path in args.files]
    flat = [flatten(data) for data in runs]
    seen = [name for values in flat for name in values]
    numbers = {name for values in flat for name, v in values.items() if v is not None}
    # The serving figures even when null (a run where all failed); others when some run has one.
    names = [n for n in FIRST if n in seen]
    names += [n for n in dict.fromkeys(seen) if n not in FIRST and n in numbers]
    if args.metrics:
        names = [n.strip() for n in args.metrics.split(",") if n.strip()]
        unknown = [n for n in names if n not in seen]
        if unknown:
            raise ValueError(f"--metrics: no file has {', '.join(unknown)}")
    metrics = {name: [values.get(name) for values in flat] for name in names}
    labels = _labels(runs, args.files)
    out: dict[str, Any] = {
        "benchmark": "compare",
        "runs": [
            {"label": label, "file": str(path), **{k: data.get(k) for k in RUN_KEYS}}
            for label, path, data in zip(labels, args.files, runs, strict=True)
        ],
        "metrics": metrics,
    }
    if args.plot is not None:
        chosen = names if args.metrics else [n for n in PLOTTED if n in metrics] or names
        plotted = {n: metrics[n] for n in chosen[:MAX_PLOTTED]}
        plot_bars(labels, plotted, args.plot, "lmd-bench compare: " + " vs ".join(labels))
        out["plot"] = str(args.plot)
    return out


def _cell(value: float | None, first: float | None, show_ratio: bool) -> str:
    if value is None:
        return "-"
    if value == int(value):
        text = f"{value:,.0f}"
    else:
        text = f"{value:,.2f}" if abs(value) >= 1 else f"{value:.3g}"
    if show_ratio and first:
        text += f" ({value / first:.2f}x)"
    return text


def summary(result: dict[str, Any]) -> str:
    labels = [r["label"] for r in result["runs"]]
    rows = [["metric", *labels]]
    for name, values in result["metrics"].items():
        first = values[0]
        rows.append([name, *(_cell(v, first, i > 0) for i, v in enumerate(values))])
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [f"{r['label']}: {r['command'] or r['file']}" for r in result["runs"]]
    for row in rows:
        lines.append("  ".join(cell.ljust(widths[0]) if c == 0 else cell.rjust(widths[c])
                               for c, cell in enumerate(row)))  # fmt: skip
    if result.get("plot"):
        lines.append(f"plot: {result['plot']}")
    return "\n".join(lines)
