"""`lmd-bench compare`: runs side by side, from the JSON `--out` writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from lmd.bench import main
from lmd.bench.compare import flatten


def serve_json(path: Path, label: str | None, throughput: float, ttft_p99: float) -> Path:
    run = {
        "benchmark": "serve", "label": label, "completed": 20, "failed": 0,
        "duration_s": 10.0, "request_throughput": 2.0, "output_throughput": throughput,
        "total_token_throughput": throughput * 3, "ignore_eos": True,
        "ttft_ms": {"mean": 50.0, "p50": 40.0, "p90": 80.0, "p99": ttft_p99},
        "tpot_ms": {"mean": 5.0, "p50": 5.0, "p90": 6.0, "p99": 7.0},
        "itl_ms": {"mean": 5.0, "p50": 5.0, "p90": 6.0, "p99": None},
        "e2e_ms": {"mean": 500.0, "p50": 450.0, "p90": 600.0, "p99": 700.0},
        "command": f"lmd-bench serve --label {label}", "environment": {"cpus": 2},
    }  # fmt: skip
    path.write_bytes(orjson.dumps(run))
    return path


def test_flatten_keeps_numbers_by_path() -> None:
    flat = flatten(
        {"a": 1, "b": {"c": 2.5, "d": None, "e": True, "f": "x"}, "environment": {"cpus": 2}}
    )
    assert flat == {"a": 1.0, "b.c": 2.5, "b.d": None}


def test_two_runs_side_by_side(tmp_path: Path, capsys: Any) -> None:
    a = serve_json(tmp_path / "before.json", None, 100.0, 90.0)
    b = serve_json(tmp_path / "after.json", "faster", 150.0, 45.0)
    out = tmp_path / "cmp.json"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    result = orjson.loads(out.read_bytes())
    assert [r["label"] for r in result["runs"]] == ["before", "faster"]  # stem, or the label
    assert result["metrics"]["output_throughput"] == [100.0, 150.0]
    assert result["metrics"]["itl_ms.p99"] == [None, None]
    names = list(result["metrics"])
    assert names[:6] == ["completed", "failed", "duration_s", "request_throughput",
                         "output_throughput", "total_token_throughput"]  # fmt: skip
    rows = {line.split()[0]: line for line in text.splitlines()}
    assert rows["output_throughput"].split()[1:] == ["100", "150", "(1.50x)"]
    assert rows["ttft_ms.p99"].split()[1:] == ["90", "45", "(0.50x)"]
    assert "faster: lmd-bench serve --label faster" in text


def test_bar_chart(tmp_path: Path) -> None:
    a = serve_json(tmp_path / "a.json", "a", 100.0, 90.0)
    b = serve_json(tmp_path / "b.json", "b", 150.0, 45.0)
    png = tmp_path / "cmp.png"
    assert main(["compare", str(a), str(b), "--plot", str(png), "--json"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_other_benchmarks_compare_too(tmp_path: Path, capsys: Any) -> None:
    one = tmp_path / "ipc1.json"
    two = tmp_path / "ipc2.json"
    one.write_bytes(orjson.dumps({"benchmark": "ipc", "messages_per_s": 100000.0,
                                  "rtt_us": {"p50": 60.0, "p99": 115.0}}))  # fmt: skip
    two.write_bytes(orjson.dumps({"benchmark": "ipc", "messages_per_s": 50000.0,
                                  "rtt_us": {"p50": 120.0, "p99": 500.0}}))  # fmt: skip
    assert main(["compare", str(one), str(two), "--metrics", "rtt_us.p50,messages_per_s"]) == 0
    rows = capsys.readouterr().out.splitlines()[-3:]
    assert rows[1].split() == ["rtt_us.p50", "60", "120", "(2.00x)"]
    assert rows[2].split() == ["messages_per_s", "100,000", "50,000", "(0.50x)"]


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (b"{broken", [], "not a readable JSON file"),
        (b"[1, 2]", [], "expected one JSON object"),
        (b'{"a": 1}', ["--metrics", "nope"], "no file has nope"),
    ],
)
def test_bad_input_is_one_line(
    tmp_path: Path, capsys: Any, content: bytes, extra: list[str], message: str
) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(content)
    assert main(["compare", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_every_subcommand_writes_out_and_compare_reads_it(tmp_path: Path, capsys: Any) -> None:
    """The shared conventions: `ipc` (added before serve) takes --out like serve does."""
    out = tmp_path / "ipc.json"
    assert main(["ipc", "--messages", "200", "--round-trips", "10", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = orjson.loads(out.read_bytes())
    assert result["messages"] == 200 and "messages/s" in printed  # the summary still prints
    assert result["command"].startswith("lmd-bench ipc") and result["date"]
    assert {"lmd", "python", "cpus"} <= set(result["environment"])
    assert main(["compare", str(out), str(out), "--json"]) == 0
    compared = orjson.loads(capsys.readouterr().out)
    assert compared["metrics"]["messages"] == [200.0, 200.0]
