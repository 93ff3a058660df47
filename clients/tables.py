"""Plain-text tables and units for lmdctl's human output."""

from __future__ import annotations


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns two spaces apart, no trailing blanks."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]
    return "\n".join(lines)


def duration(seconds: float | None) -> str:
    """An uptime: 42s, 3m05s, 2h07m; "-" for None."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def human_bytes(n: float | None) -> str:
    """512B, 1.5KiB, ... up to GiB; "-" for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def latency(seconds: float | None) -> str:
    """A latency: 0.8ms, 12.3ms, 1.25s; "-" for None (nothing observed)."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.1f}ms"
    return f"{seconds:.2f}s"
