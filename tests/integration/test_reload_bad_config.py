"""`lmdctl reload` of a bad config file through a real daemon's control socket: all or nothing.

Each bad file is answered 400 `bad_config` with one line; `lmdctl config` is the same
before and after, and the body-size limit still holds in an api worker started after.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson

from tests.integration.daemon import DISAGGREGATED, Daemon, lmdctl, wait_until

GOOD = b"max_request_bytes = 4096\n"
# (file content, what the one-line error says)
BAD_FILES = [
    (b"max_request_bytes = 99999999999999999999\n", "does not fit in a 64-bit integer"),
    (b'model_name = "caf\xe9"\n', "not UTF-8"),  # Latin-1, not UTF-8
    (b"max_request_bytes = = 1\n", "not valid TOML"),
    (b"max_request_bytes = -5\n", "must be >= 1024"),
    (b"max_request_bytez = 2048\n", "did you mean 'max_request_bytes'"),
    (b'max_request_bytes = "2048"\n', "expected an integer, got a string"),
    (b'max_request_bytes = 2048\nchat_template = "~nosuchuser/t.json"\n', "chat_template"),
]


def running_config(daemon: Daemon) -> dict[str, object]:
    out = lmdctl(daemon, "--json", "config")
    assert out.returncode == 0, out.stderr
    config: dict[str, object] = orjson.loads(out.stdout)
    return config


def test_a_bad_reload_changes_nothing_and_is_400_in_one_line(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    config = tmp_path / "lmd.toml"
    config.write_bytes(GOOD)
    d = make_daemon(*DISAGGREGATED, "--config", str(config)).start()
    before = running_config(d)
    assert before["values"]["max_request_bytes"] == 4096  # type: ignore[index]
    for content, says in BAD_FILES:
        config.write_bytes(content)
        out = lmdctl(d, "reload")
        assert out.returncode == 1, (content, out.stdout, out.stderr)
        assert out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith(f"lmdctl: {config}: ") and "(bad_config)" in out.stderr
        assert says in out.stderr, out.stderr
        r = d.control().post("/v1/reload")
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_config"
        assert running_config(d) == before, content
    assert d.status()["state"] == "running"

    # An api worker started after the bad reloads runs with the limit that was running.
    old = d.worker("api-0")["pid"]
    assert lmdctl(d, "restart", "api-0").returncode == 0

    def restarted() -> bool:
        api = d.worker("api-0")
        return api["pid"] not in (None, old) and api["state"] == "running"

    wait_until(restarted, 20, "api-0 restarted")
    body = {"model": "m", "prompt": "x" * (2 << 20)}  # 2 MiB
    r = httpx.post(f"{d.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
