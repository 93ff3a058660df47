"""Supervisor operations on a supervisor that is not serving: no sockets, no workers spawned.

The router is a fake that records what would go to each worker.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from lmd import protocol
from lmd.config_loader import ConfigSource
from lmd.supervisor.control import build_control_app
from lmd.supervisor.errors import BadConfig
from lmd.supervisor.states import DaemonState, WorkerState
from lmd.supervisor.supervisor import Supervisor

NO_DEFAULT_FILE = Path("/nonexistent/lmd.toml")
GOOD = b'max_request_bytes = 4096\nlog_level = "info"\n'
# A bad file each way a user can write one; the reload must change nothing.
BAD_FILES = {
    "int past int64": b"max_request_bytes = 99999999999999999999\n",
    "int past int64, not live": b"session_len = 99999999999999999999\n",
    "invalid UTF-8": b'model_name = "caf\xe9"\nmax_request_bytes = 2048\n',
    "invalid TOML": b"max_request_bytes = = 2048\n",
    "negative size": b"max_request_bytes = -5\n",
    "unknown key": b"max_request_bytez = 2048\n",
    "wrong type": b'log_level = "debug"\nmax_request_bytes = "2048"\n',
    "valid live key, bad other key": b'log_level = "debug"\nblock_size = 0\n',
    "home of no user": b'log_level = "debug"\nchat_template = "~nosuchuser/t.json"\n',
    "backoff over its cap": b"restart_backoff = 1e308\n",
}


class FakeRouter:
    def __init__(self) -> None:
        self.sent: list[tuple[str, protocol.Message]] = []

    async def send(self, name: str, msg: protocol.Message) -> None:
        self.sent.append((name, msg))


def running_supervisor(tmp_path: Path, content: bytes = GOOD) -> tuple[Supervisor, Path]:
    file = tmp_path / "lmd.toml"
    file.write_bytes(content)
    runtime = {"runtime_dir": str(tmp_path / "rt")}
    loaded = ConfigSource(cli=runtime, path=file, default_path=NO_DEFAULT_FILE).load(env={})
    sup = Supervisor(loaded, "cpu", os.getpid(), build_control_app)
    sup.router = FakeRouter()  # type: ignore[assignment]
    sup.state = DaemonState.RUNNING
    return sup, file


def snapshot(sup: Supervisor) -> tuple[Any, ...]:
    specs = {name: child.spec for name, child in sup.children.items()}
    return sup.loaded.to_json(), sup.config, specs


@pytest.mark.parametrize("content", BAD_FILES.values(), ids=BAD_FILES.keys())
async def test_a_bad_file_changes_nothing(tmp_path: Path, content: bytes) -> None:
    sup, file = running_supervisor(tmp_path)
    before = snapshot(sup)
    file.write_bytes(content)
    with pytest.raises(BadConfig) as refused:
        await sup.reload()
    assert refused.value.code == "bad_config"
    message = refused.value.message
    assert message.startswith(f"{file}: ") and "\n" not in message, message
    assert snapshot(sup) == before
    assert sup.router.sent == []  # type: ignore[attr-defined]


async def test_a_good_file_applies_live_keys_everywhere(tmp_path: Path) -> None:
    sup, file = running_supervisor(tmp_path)
    file.write_bytes(b'max_request_bytes = 2048\nlog_level = "info"\nsession_len = 4096\n')
    reply = await sup.reload()
    assert (reply["applied"], reply["needs_restart"]) == (["max_request_bytes"], ["session_len"])
    assert sup.config.max_request_bytes == 2048 and sup.config.session_len is None
    assert all(c.spec.config["max_request_bytes"] == 2048 for c in sup.children.values())
    sent = sup.router.sent  # type: ignore[attr-defined]
    assert sorted(name for name, _ in sent) == sorted(sup.children)
    assert all(msg == protocol.Reconfigure({"max_request_bytes": 2048}) for _, msg in sent)


def test_the_drain_waits_for_running_workers_alone(tmp_path: Path) -> None:
    """A stop during start-up: workers still starting (loading their models, silent) hold
    no request, so the drain is over at once for them; a running worker holds it until
    it reports, since the drain began, that it holds nothing."""
    sup, _ = running_supervisor(tmp_path)
    sup._drain_started = time.monotonic()
    assert all(c.state == WorkerState.STARTING for c in sup.children.values())
    assert sup._drained()
    first = next(iter(sup.children.values()))
    first.set_state(WorkerState.RUNNING)
    assert not sup._drained()  # not heard from since the drain began
    first.heard(protocol.Heartbeat(first.name, inflight=2, num_dropped=0, stats={}))
    assert not sup._drained()
    first.heard(protocol.Heartbeat(first.name, inflight=0, num_dropped=0, stats={}))
    assert sup._drained()
