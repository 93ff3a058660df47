"""`lmd-bench serve` against a scripted fake OpenAI server.

The metric tests run on a virtual clock (see test_bench_serve_fakes.py): the server's
scripted delays are the only time that passes, so every figure is exact.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from lmd.bench import main
from lmd.bench.serve_client import Load, Run, Target, http_client, run_load
from lmd.bench.serve_data import Prompt
from lmd.bench.serve_metrics import summarize
from lmd.bench.serve_processes import shares
from tests.unit.test_bench_serve_fakes import FakeOpenAI, Script, fake_server_thread, run_virtual

EXACT = 1e-3  # figures are reported in ms rounded to the microsecond
ISSUE_KEYS = {
    "completed", "failed", "duration_s", "request_throughput", "output_throughput",
    "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "command",
    "environment",
}  # fmt: skip


def bench(
    scripts: dict[str, Script],
    prompts: list[str],
    load: Load,
    *,
    endpoint: str = "/v1/completions",
    timeout_s: float = 3600.0,
    url: str | None = None,
) -> tuple[Run, FakeOpenAI]:
    """Every prompt sent to a fake server that answers prompt text -> script."""

    def script(body: dict[str, Any]) -> Script:
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        return scripts[text]

    async def scenario() -> tuple[Run, FakeOpenAI]:
        server = FakeOpenAI(script)
        base = await server.start()
        target = Target(url=url or base, model="m", endpoint=endpoint, timeout_s=timeout_s)
        items = [Prompt(text, input_len=3, output_len=8) for text in prompts]
        async with http_client(target) as client:
            run = await run_load(client, target, load, items, clock=asyncio.get_running_loop().time)
        await server.close()
        return run, server

    return run_virtual(scenario())


TWO = {
    # 5 tokens: first at 100 ms, then one every 20 ms.
    "a": Script(ttft=0.1, gaps=[0.02] * 4, completion_tokens=5),
    # 10 tokens in 2 chunks: first at 300 ms, the other 9 at once 50 ms later.
    "b": Script(ttft=0.3, gaps=[0.05], completion_tokens=10, cached_tokens=4),
}


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_latencies_and_throughputs_are_exact(endpoint: str) -> None:
    run, server = bench(TWO, ["a", "b"], Load(concurrency=1), endpoint=endpoint)
    # One at a time: a runs 0-180 ms, b 180-530 ms. In chat, the role-only first chunk
    # carries no text and does not count as the first token.
    out = summarize(run.results, run.duration, {"ttft": 200, "tpot": 25})
    assert (out["completed"], out["failed"]) == (2, 0)
    assert out["duration_s"] == pytest.approx(0.53, abs=1e-6)
    assert out["ttft_ms"] == pytest.approx(
        {"mean": 200, "p50": 200, "p90": 280, "p99": 298}, abs=EXACT
    )
    # TPOT: a (180 - 100) / 4 = 20; b (350 - 300) / 9 = 5.556 (chunks of many tokens).
    assert out["tpot_ms"] == pytest.approx(
        {"mean": 12.778, "p50": 12.778, "p90": 18.556, "p99": 19.856}, abs=EXACT
    )
    # ITL: the gaps between text chunks, pooled: 20, 20, 20, 20, 50.
    assert out["itl_ms"] == pytest.approx(
        {"mean": 26, "p50": 20, "p90": 38, "p99": 48.8}, abs=EXACT
    )
    assert out["e2e_ms"] == pytest.approx(
        {"mean": 265, "p50": 265, "p90": 333, "p99": 348.3}, abs=EXACT
    )
    assert (out["total_input_tokens"], out["total_output_tokens"]) == (14, 15)  # from usage
    assert out["total_cached_tokens"] == 4
    assert out["request_throughput"] == pytest.approx(2 / 0.53, abs=1e-4)
    assert out["output_throughput"] == pytest.approx(15 / 0.53, abs=1e-4)
    assert out["total_token_throughput"] == pytest.approx(29 / 0.53, abs=1e-4)
    # Goodput: a meets TTFT <= 200 and TPOT <= 25, b misses the TTFT.
    assert (out["good_requests"], out["goodput"]) == (1, pytest.approx(1 / 0.53, abs=1e-4))
    assert all(b["stream_options"] == {"include_usage": True} for b in server.bodies)


def test_goodput_limits_are_inclusive_to_the_millisecond() -> None:
    run, _ = bench(TWO, ["a", "b"], Load(concurrency=1))
    assert summarize(run.results, run.duration, {"e2e": 180})["good_requests"] == 1
    assert summarize(run.results, run.duration, {"e2e": 179.999})["good_requests"] == 0
    assert summarize(run.results, run.duration, {"tpot": 5.556})["good_requests"] == 1


def test_without_usage_each_text_chunk_counts_as_one_token() -> None:
    run, _ = bench({"a": Script(ttft=0.1, gaps=[0.02, 0.02])}, ["a"], Load())
    out = summarize(run.results, run.duration)
    assert (out["total_input_tokens"], out["total_output_tokens"]) == (3, 3)  # prompt's len
    assert out["tpot_ms"]["mean"] == pytest.approx(20, abs=EXACT)
    assert "goodput" not in out


def test_concurrency_caps_requests_in_flight() -> None:
    scripts = {str(i): Script(ttft=0.1, completion_tokens=1) for i in range(5)}
    run, _ = bench(scripts, list(scripts), Load(concurrency=2))
    starts = [round(r.start - run.start, 6) for r in run.results]
    assert starts == [0, 0, 0.1, 0.1, 0.2]
    assert run.duration == pytest.approx(0.3)


def test_poisson_arrivals_are_seeded_and_kept_exactly() -> None:
    scripts = {str(i): Script(ttft=0.5, completion_tokens=1) for i in range(100)}
    load = Load(request_rate=10, seed=3)
    run, _ = bench(scripts, list(scripts), load)
    starts = [r.start - run.start for r in run.results]
    assert starts == pytest.approx(load.arrivals(100), abs=1e-9)  # no drift, no cap
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.25)
    assert load.arrivals(5) == Load(request_rate=10, seed=3).arrivals(5)
    assert load.arrivals(5) != Load(request_rate=10, seed=4).arrivals(5)
    assert Load().arrivals(3) == [0, 0, 0]


def test_failures_are_counted_by_kind_and_the_run_goes_on() -> None:
    scripts = {
        "ok": Script(ttft=0.1, gaps=[0.02], completion_tokens=2),
        "500": Script(status=500),
        "error": Script(ttft=0.1, gaps=[0.02] * 3, error_after=2),
        "drop": Script(ttft=0.1, gaps=[0.02] * 3, drop_after=2),
        "hang": Script(hang=True),
        "cut": Script(ttft=0.1, finish=False),  # a clean end without [DONE] or finish_reason
    }
    run, _ = bench(scripts, list(scripts), Load(), timeout_s=2)
    out = summarize(run.results, run.duration)
    assert (out["completed"], out["failed"]) == (1, 5)
    assert out["failed_kinds"] == {
        "http_500": 1, "stream_error": 1, "dropped": 1, "timeout": 1, "incomplete": 1,
    }  # fmt: skip
    assert "scripted failure" in out["failed_examples"]["http_500"]
    assert "scripted stream error" in out["failed_examples"]["stream_error"]
    # Only the request that succeeded is in the figures; the hang ended at the timeout.
    assert out["ttft_ms"]["mean"] == pytest.approx(100, abs=EXACT)
    assert out["e2e_ms"]["p99"] == pytest.approx(120, abs=EXACT)
    assert max(r.e2e for r in run.results) == pytest.approx(2.0)


def test_a_server_that_is_not_there_is_counted_not_raised() -> None:
    from tests.integration.daemon import free_port

    url = f"http://127.0.0.1:{free_port()}"
    run, _ = bench({"a": Script()}, ["a", "a"], Load(), url=url)
    assert summarize(run.results, run.duration)["failed_kinds"] == {"connect": 2}


# Through the command line, on a real clock --------------------------------------------------


def quick(body: dict[str, Any]) -> Script:
    return Script(gaps=[0.0] * (body["max_tokens"] - 1), completion_tokens=body["max_tokens"])


def test_command_writes_the_json_it_prints(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "run.json"
    with fake_server_thread(quick) as server:
        code = main([
            "serve", "--url", server.url, "--num-prompts", "6", "--input-len", "5",
            "--output-len", "4", "--concurrency", "2", "--api-key", "sk-secret", "--json",
            "--out", str(out), "--goodput", "ttft:10000", "--ignore-eos",
        ])  # fmt: skip
    assert code == 0
    printed = orjson.loads(capsys.readouterr().out)
    written = orjson.loads(out.read_bytes())
    assert printed == written
    assert ISSUE_KEYS | {"goodput"} <= set(written)
    assert set(written["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert (written["completed"], written["failed"]) == (6, 0)
    assert written["total_output_tokens"] == 24 and written["model"] == "fake-model"
    assert written["server"] == "fake-openai" and written["environment"]["lmd"]
    assert "sk-secret" not in written["command"] and "--api-key ***" in written["command"]
    assert len(server.bodies) == 7  # one warm-up request, not counted, not a measured prompt
    assert server.bodies[0]["prompt"] not in {b["prompt"] for b in server.bodies[1:]}
    assert all(h["authorization"] == "Bearer sk-secret" for h in server.headers)
    assert all(b["ignore_eos"] and len(b["prompt"].split()) == 5 for b in server.bodies)


def test_summary_table_and_plot(tmp_path: Path, capsys: Any) -> None:
    png = tmp_path / "run.png"
    with fake_server_thread(quick) as server:
        assert main(["serve", "--url", server.url, "--num-prompts", "4", "--input-len", "3",
                     "--output-len", "3", "--plot", str(png), "--progress"]) == 0  # fmt: skip
    text, err = capsys.readouterr()
    assert err.endswith(f"[{'#' * 30}] 4/4 failed 0 {err.split()[-2]} s\n")
    assert "completed / failed        4 / 0" in text and "TTFT" in text and "ITL" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_without_matplotlib_is_one_line_before_any_request(
    monkeypatch: pytest.MonkeyPatch, capsys: Any, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    with fake_server_thread(quick) as server:
        code = main(["serve", "--url", server.url, "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "pip install" in err and "matplotlib" in err
    assert server.bodies == []


def test_failing_server_through_the_command(tmp_path: Path, capsys: Any) -> None:
    with fake_server_thread(lambda body: Script(status=500)) as server:
        assert main(["serve", "--url", server.url, "--num-prompts", "3"]) == 2
        assert "warm-up request failed (http_500" in capsys.readouterr().err
        out = tmp_path / "failed.json"
        args = ["serve", "--url", server.url, "--num-prompts", "3", "--warmup", "0"]
        assert main([*args, "--out", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    assert (result["completed"], result["failed"], result["failed_kinds"]) == (
        0, 3, {"http_500": 3},
    )  # fmt: skip
    assert result["ttft_ms"]["p50"] is None and result["request_throughput"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-prompts", "0"], "--num-prompts"),
        (["--request-rate", "0"], "--request-rate"),
        (["--goodput", "ttfb:100"], "one of ttft, tpot, e2e"),
        (["--goodput", "ttft:fast"], "NAME:MILLISECONDS"),
        (["--range-ratio", "1"], "--range-ratio"),
        (["--extra-body", "[1]"], "JSON object"),
        (["--prefix-len", "4", "--dataset", "x.json"], "not both"),
        (["--out", "/nonexistent/dir/x.json"], "does not exist"),
    ],
)
def test_bad_arguments_are_one_line_and_status_2(
    args: list[str], message: str, capsys: Any
) -> None:
    assert main(["serve", "--url", "http://127.0.0.1:9", "--warmup", "0", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_no_model_listed_is_a_clear_error(capsys: Any) -> None:
    from tests.integration.daemon import free_port

    assert main(["serve", "--url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "cannot list models" in capsys.readouterr().err


def test_request_rate_is_recorded(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with fake_server_thread(quick) as server:
        args = ["serve", "--url", server.url, "--num-prompts", "3", "--output-len", "2"]
        assert main([*args, "--request-rate", "50", "--out", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    assert result["request_rate"] == 50 and result["concurrency"] is None
    assert not math.isinf(result["duration_s"])


def test_several_client_processes_drive_one_run(tmp_path: Path) -> None:
    """Each process takes its share of the prompts and of the concurrency; one run."""
    out = tmp_path / "run.json"
    with fake_server_thread(quick) as server:
        code = main([
            "serve", "--url", server.url, "--num-prompts", "9", "--input-len", "4",
            "--output-len", "3", "--concurrency", "3", "--client-processes", "2",
            "--out", str(out), "--warmup", "0",
        ])  # fmt: skip
    assert code == 0
    written = orjson.loads(out.read_bytes())
    assert (written["completed"], written["failed"]) == (9, 0)
    assert written["total_output_tokens"] == 27
    assert len(written["client_cpu_cores"]) == 2
    assert all(0 <= c < 2 for c in written["client_cpu_cores"])
    prompts = sorted(b["prompt"] for b in server.bodies)  # each measured prompt once
    assert len(prompts) == 9 and len(set(prompts)) == 9


def test_client_shares_split_prompts_concurrency_and_rate() -> None:
    plan = shares(Load(request_rate=10.0, concurrency=5, seed=3), 7, 2)
    assert [indexes for indexes, _ in plan] == [[0, 2, 4, 6], [1, 3, 5]]
    assert [load.concurrency for _, load in plan] == [3, 2]
    assert [load.request_rate for _, load in plan] == [5.0, 5.0]
    assert len({load.seed for _, load in plan}) == 2  # their own arrival times
    assert len(shares(Load(concurrency=None), 1, 3)) == 1  # no process without prompts
