"""`lmd-bench serve` and `compare` against a real daemon serving SmolLM2-135M on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from lmd.bench import main
from tests.integration.daemon import Daemon, served

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    yield from served(
        Daemon("--mode", "hybrid", "--heartbeat-timeout", "10", "--drain-timeout", "5")
    )


def serve(daemon: Daemon, out: Path, *extra: str) -> dict[str, Any]:
    args = ["serve", "--url", daemon.url, "--input-len", "32", "--output-len", "8"]
    assert main([*args, "--ignore-eos", "--concurrency", "10", "--out", str(out), *extra]) == 0
    result: dict[str, Any] = orjson.loads(out.read_bytes())
    return result


def test_twenty_prompts_complete_with_a_real_plot(daemon: Daemon, tmp_path: Path) -> None:
    png = tmp_path / "serve.png"
    result = serve(daemon, tmp_path / "completions.json", "--num-prompts", "20",
                   "--plot", str(png), "--goodput", "e2e:600000")  # fmt: skip
    assert (result["completed"], result["failed"]) == (20, 0)
    assert result["model"] == "SmolLM2-135M-Instruct"
    assert result["total_output_tokens"] == 20 * 8  # ignore_eos: exactly max_tokens each
    assert result["total_input_tokens"] == 20 * 32  # one token a word for this tokenizer
    assert result["goodput"] == result["request_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = result[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], key
    assert result["ttft_ms"]["p50"] < result["e2e_ms"]["p50"]
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 20_000
    # The daemon's own breakdown of the run (its /metrics before and after)
    rows = {(r["stage"], r["role"]): r for r in result["stages"]["stages"]}
    per_request = [("api", "api"), ("tokenizer", "tokenizer"), ("queue", "hybrid"),
                   ("prefill", "hybrid")]  # fmt: skip
    per_message = [("step", "hybrid"), ("to_tokenizer", "tokenizer"), ("to_api", "api"),
                   ("detokenize", "tokenizer"), ("sse_write", "api")]  # fmt: skip
    for stage, role in per_request + per_message:
        assert 0 < rows[(stage, role)]["mean_ms"] < 60_000, stage
    for pair in per_request:  # each measured request once; the warm-up is not in the run
        assert rows[pair]["count"] == 20, pair
    assert rows[("step", "hybrid")]["count"] >= 8  # 10 at once, 8 tokens each
    assert rows[("sse_write", "api")]["count"] >= 20  # a write at least per request
    assert set(result["stages"]["cpu_cores"]) >= {"api-0", "tokenizer-0", "hybrid-0"}
    assert all(0 <= c < 4 for c in result["stages"]["cpu_cores"].values())


@pytest.mark.slow  # another ~15 s; the fake-server unit tests cover chat and compare
def test_chat_endpoint_then_compare(daemon: Daemon, tmp_path: Path, capsys: Any) -> None:
    chat = serve(daemon, tmp_path / "chat.json", "--num-prompts", "8",
                 "--endpoint", "/v1/chat/completions", "--label", "chat")  # fmt: skip
    assert (chat["completed"], chat["failed"]) == (8, 0)
    assert chat["total_input_tokens"] > 8 * 32  # the chat template adds its own tokens
    prefix = serve(daemon, tmp_path / "prefix.json", "--num-prompts", "8",
                   "--prefix-len", "128", "--num-prefixes", "2", "--label", "prefix",
                   "--concurrency", "1")  # fmt: skip
    assert (prefix["completed"], prefix["failed"]) == (8, 0)
    # One at a time: after the first of each group, the group's prefix (2 blocks) is cached.
    assert prefix["total_cached_tokens"] >= 6 * 128
    png = tmp_path / "compare.png"
    files = [str(tmp_path / "chat.json"), str(tmp_path / "prefix.json")]
    capsys.readouterr()
    assert main(["compare", *files, "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "output_throughput" in table and "chat" in table and "prefix" in table
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 20_000
