"""PNG figures for `lmd-bench serve --plot` and `lmd-bench compare --plot` (matplotlib).

matplotlib is optional (`pip install 'lmd[bench]'`): `require_matplotlib` is called before
a run starts, so that a missing package is one clear line, not a lost hour of benchmark.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmd.bench.serve_client import Run

MISSING = "--plot needs matplotlib: pip install 'lmd[bench]' (or: pip install matplotlib)"


def require_matplotlib() -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(MISSING) from None
    matplotlib.use("Agg")  # files only; never a display


def _cdf(ax: Any, values_ms: list[float], label: str) -> None:
    values = sorted(v for v in values_ms if v > 0)  # the axis is logarithmic
    if values:
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)


def _timeline(run: Run, bins: int = 40) -> tuple[list[float], list[float], list[float]]:
    """(bin centres s, output tokens/s, requests in flight at each centre)."""
    width = max(run.duration / bins, 1e-3)
    tokens = [0.0] * bins
    for r in run.results:
        if r.ok and r.chunk_times:
            # usage gives a request's token count, not each chunk's: spread it evenly.
            each = r.output_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                tokens[min(int((t - run.start) / width), bins - 1)] += each
    centres = [(i + 0.5) * width for i in range(bins)]
    in_flight = [
        float(sum(r.start - run.start <= c < r.end - run.start for r in run.results))
        for c in centres
    ]
    return centres, [n / width for n in tokens], in_flight


def plot_serve(run: Run, path: Path, title: str) -> None:
    """Latency CDFs (TTFT/E2E, TPOT/ITL) and throughput and load over time."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    done = [r for r in run.results if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (lat, tok), (thr, load) = axes
    _cdf(lat, [r.ttft * 1000 for r in done if r.ttft is not None], "TTFT")
    _cdf(lat, [r.e2e * 1000 for r in done], "E2E")
    _cdf(tok, [r.tpot * 1000 for r in done if r.tpot is not None], "TPOT")
    _cdf(tok, [g * 1000 for r in done for g in r.itls], "ITL")
    for ax, what in ((lat, "request latency"), (tok, "per-token latency")):
        ax.set(xscale="log", xlabel="ms (log scale)", ylabel="fraction at or below", title=what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
    centres, tok_s, in_flight = _timeline(run)
    thr.plot(centres, tok_s)
    thr.set(xlabel="s since start", ylabel="output tokens/s", title="output throughput")
    load.step(centres, in_flight, where="mid")
    load.set(xlabel="s since start", ylabel="requests", title="requests in flight")
    for ax in (thr, load):
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_bars(
    labels: list[str], metrics: dict[str, list[float | None]], path: Path, title: str
) -> None:
    """One small bar chart per metric, one bar per run (missing values left out)."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    cols = min(4, len(metrics))
    rows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    colours = [f"C{i % 10}" for i in range(len(labels))]
    for ax, (name, values) in zip(axes.flat, metrics.items(), strict=False):
        heights = [v if v is not None else 0.0 for v in values]
        ax.bar(range(len(labels)), heights, color=colours)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
