"""`lmdctl metrics` and shell completion against a real daemon (hybrid mode, fake backend:
the real tokenizer, api, engine loop and control socket, no model to run)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.daemon import Daemon, lmdctl, served

BODY = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello there", "temperature": 0}
MAX_TOKENS = 8
NUM_BEFORE = 5  # requests answered before the metrics call


@pytest.fixture(scope="module")
def fake_daemon() -> Iterator[Daemon]:
    yield from served(
        Daemon(
            "--mode",
            "hybrid",
            "--decode-backend",
            "fake",
            "--cache-max-entry-count",
            "64",
            "--log-level",
            "warning",
        )
    )


def complete(client: httpx.Client) -> dict[str, Any]:
    r = client.post("/v1/completions", json={**BODY, "max_tokens": MAX_TOKENS, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def metrics_under_load(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `lmdctl ARGS metrics --interval 2` while requests keep completing."""
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=daemon.url, timeout=30) as client:
            while not stop.is_set():
                complete(client)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        return lmdctl(daemon, *args, "metrics", "--interval", "2", timeout=60)
    finally:
        stop.set()
        thread.join(30)


def check_gpu_section(gpu: dict[str, Any]) -> None:
    if importlib.util.find_spec("pynvml") is None:
        assert gpu == {
            "available": False,
            "reason": "pynvml not installed (pip install 'lmd[gpu]')",
            "devices": [],
        }
    elif not gpu["available"]:  # pynvml without a driver or a device, as in CI
        assert gpu["reason"].startswith("no GPU") and gpu["devices"] == []
    else:
        assert gpu["devices"] and gpu["devices"][0]["memory_total_bytes"] > 0


def test_metrics_json_shows_completed_requests_rates_kv_and_gpu(fake_daemon: Daemon) -> None:
    with httpx.Client(base_url=fake_daemon.url, timeout=30) as client:
        for _ in range(NUM_BEFORE):
            assert complete(client)["usage"]["completion_tokens"] == MAX_TOKENS
    out = metrics_under_load(fake_daemon, "--json")
    assert out.returncode == 0, out.stderr
    m = orjson.loads(out.stdout)
    assert m["state"] == "running" and m["api"]["error"] is None
    assert m["api"]["sources"] == ["api-0"]

    total = m["api"]["since_start"]
    assert total["requests"]["200"] >= NUM_BEFORE
    assert total["generation_tokens"] >= NUM_BEFORE * MAX_TOKENS
    assert total["ttft"]["count"] >= NUM_BEFORE and total["ttft"]["p50_s"] > 0
    assert total["e2e"]["p99_s"] >= total["e2e"]["p50_s"] > 0

    window = m["api"]["window"]
    assert window["generation_tokens_per_s"] > 0 and window["prompt_tokens_per_s"] > 0
    assert window["requests_per_s"] > 0 and window["requests"]["200"] >= 1
    assert window["tpot"]["count"] >= 1 and window["tpot"]["p50_s"] > 0

    (engine,) = m["engines"]
    assert engine["name"] == "hybrid-0" and engine["state"] == "running"
    assert engine["kv"]["total_blocks"] == 64
    assert 0 <= engine["kv"]["used_blocks"] <= 64
    assert engine["kv"]["usage"] == engine["kv"]["used_blocks"] / 64
    assert engine["running"] >= 0 and engine["waiting"] >= 0
    check_gpu_section(m["gpu"])


def test_metrics_table(fake_daemon: Daemon) -> None:
    out = metrics_under_load(fake_daemon)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("lmdd running   model SmolLM2-135M-Instruct   from api-0 over 2s")
    generation = next(line for line in text.splitlines() if line.startswith("generation"))
    assert "tok/s" in generation and not generation.split()[1].startswith("0.0")
    assert any(line.startswith("hybrid-0  running") for line in text.splitlines())
    assert "/64" in text
    assert "estimates from the /metrics histogram buckets" in text
    assert "GPU" in text


def test_bash_completes_the_running_daemons_worker_names(
    fake_daemon: Daemon, tmp_path: Path
) -> None:
    script = tmp_path / "lmdctl.bash"
    script.write_text(lmdctl(fake_daemon, "completion", "bash", timeout=60).stdout)
    words = f"lmdctl --socket {fake_daemon.socket_path} restart ''"
    program = (
        f'source {script}; COMP_WORDS=({words}); COMP_CWORD=4; _lmdctl; echo "${{COMPREPLY[*]}}"'
    )
    # The lmdctl that the completion runs is this environment's.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "-c", program], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["tokenizer-0", "hybrid-0", "api-0"]
