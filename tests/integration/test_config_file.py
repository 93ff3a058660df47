"""`lmdd serve --config FILE` against a real daemon: precedence, lmdctl config and reload."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import orjson

from tests.integration.daemon import DISAGGREGATED, Daemon, free_port, lmdctl, wait_until

# Bare tokenizer/prefill/decode/api workers: fast to start, no model loaded.


def test_file_values_apply_and_flags_override_them(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    file_port = free_port()
    config = tmp_path / "lmd.toml"
    config.write_text(
        f'port = {file_port}\nmodel_name = "from-file"\nprefill_workers = 2\nlog_level = "debug"\n'
    )
    # The harness passes --port and --runtime-dir; --log-level overrides the file too.
    d = make_daemon(*DISAGGREGATED, "--config", str(config), "--log-level", "info").start()
    status = d.status()
    assert status["model"] == "from-file"
    assert [w["name"] for w in status["workers"] if w["role"] == "prefill"] == [
        "prefill-0",
        "prefill-1",
    ]
    assert httpx.get(f"{d.url}/v1/models").json()["data"][0]["id"] == "from-file"
    assert d.port != file_port

    out = lmdctl(d, "--json", "config")
    assert out.returncode == 0, out.stderr
    c = orjson.loads(out.stdout)
    assert c["file"] == str(config)
    assert (c["values"]["port"], c["origins"]["port"]) == (d.port, "command line")
    assert (c["values"]["log_level"], c["origins"]["log_level"]) == ("info", "command line")
    assert c["origins"]["model_name"] == f"file {config}"
    assert c["origins"]["drain_timeout"] == "default"
    table = lmdctl(d, "config").stdout
    assert f"config file: {config}" in table and "prefill_workers" in table


def test_reload_applies_the_log_level_and_lists_what_needs_a_restart(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    config = tmp_path / "lmd.toml"
    config.write_text('log_level = "info"\ndrain_timeout = 5\n')
    d = make_daemon(*DISAGGREGATED, "--config", str(config)).start()
    config.write_text('log_level = "debug"\ndrain_timeout = 7\n')
    out = lmdctl(d, "reload")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"reloaded {config}",
        "applied: log_level (info -> debug)",
        "needs a restart: drain_timeout (5.0 -> 7.0)",
    ]
    c = orjson.loads(lmdctl(d, "--json", "config").stdout)
    assert c["values"]["log_level"] == "debug" and c["values"]["drain_timeout"] == 5.0
    assert c["needs_restart"] == {"drain_timeout": 7.0}
    assert "config reloaded: applied log_level; needs a restart: drain_timeout" in d.log()
    for worker in ("tokenizer-0", "prefill-0", "decode-0", "api-0"):  # live in every worker
        wait_until(lambda w=worker: f"{w}: applied log_level" in d.log(), 10, f"{worker} level")  # type: ignore[misc]

    again = orjson.loads(lmdctl(d, "--json", "reload").stdout)  # nothing new since
    assert again["applied"] == [] and again["needs_restart"] == ["drain_timeout"]

    config.write_text("log_level = 3\n")
    bad = lmdctl(d, "reload")
    assert bad.returncode == 1
    assert f"{config}: log_level: expected a string" in bad.stderr and "bad_config" in bad.stderr
    assert d.status()["state"] == "running"


def test_reload_applies_api_keys_and_the_body_limit_live(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    config = tmp_path / "lmd.toml"
    config.write_text("max_request_bytes = 100000\n")
    d = make_daemon(*DISAGGREGATED, "--config", str(config)).start()
    assert httpx.get(f"{d.url}/v1/models").status_code == 200
    config.write_text('api_keys = ["sesame"]\nmax_request_bytes = 2048\n')
    out = lmdctl(d, "reload")
    assert out.returncode == 0, out.stderr
    assert "applied: " in out.stdout and "api_keys" in out.stdout
    wait_until(lambda: "api-0: applied api_keys, max_request_bytes" in d.log(), 10, "api reload")
    assert httpx.get(f"{d.url}/v1/models").status_code == 401
    good = {"Authorization": "Bearer sesame"}
    assert httpx.get(f"{d.url}/v1/models", headers=good).status_code == 200
    big = {"model": "m", "prompt": "x" * 4000}
    r = httpx.post(f"{d.url}/v1/completions", json=big, headers=good)
    assert r.status_code == 413 and "2048" in r.json()["error"]["message"]
    assert httpx.get(f"{d.url}/health").status_code == 200  # exempt from keys


def test_a_bad_config_file_exits_2_naming_the_key_and_the_file(tmp_path: Path) -> None:
    config = tmp_path / "lmd.toml"
    config.write_text("port = 8000\nheartbeat_timeuot = 10\n")
    out = subprocess.run(
        [sys.executable, "-m", "lmd", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "LMD_RUNTIME_DIR": str(tmp_path / "rt")},
    )
    assert out.returncode == 2
    assert out.stderr == (
        f"lmdd: {config}: unknown key 'heartbeat_timeuot' (did you mean 'heartbeat_timeout'?)\n"
    )
    assert not (tmp_path / "rt").exists()  # nothing was started
