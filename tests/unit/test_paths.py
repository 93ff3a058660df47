from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmd.paths import RuntimeDirError, prepare_runtime_dir, resolve_runtime_dir
from lmd.supervisor.runtime_lock import AlreadyRunning, RuntimeLock


def test_runtime_dir_precedence() -> None:
    env = {"RUNTIME_DIRECTORY": "/run/lmd:/run/other", "XDG_RUNTIME_DIR": "/run/user/1"}
    assert resolve_runtime_dir("/srv/x", env) == Path("/srv/x")
    assert resolve_runtime_dir(None, env) == Path("/run/lmd")
    assert resolve_runtime_dir(None, {"XDG_RUNTIME_DIR": "/run/user/1"}) == Path("/run/user/1/lmd")
    fallback = resolve_runtime_dir(None, {})
    assert fallback.name == f"lmd-{os.getuid()}"


def test_prepare_creates_private_dir(tmp_path: Path) -> None:
    rd = tmp_path / "rt"
    prepare_runtime_dir(rd)
    assert rd.is_dir() and (rd.stat().st_mode & 0o777) == 0o750


def test_prepare_refuses_world_writable_and_long_paths(tmp_path: Path) -> None:
    rd = tmp_path / "open"
    rd.mkdir()
    rd.chmod(0o777)
    with pytest.raises(RuntimeDirError, match="writable by everyone"):
        prepare_runtime_dir(rd)
    with pytest.raises(RuntimeDirError, match="too long for unix sockets"):
        prepare_runtime_dir(tmp_path / ("x" * 120))
    (tmp_path / "file").write_text("")
    with pytest.raises(RuntimeDirError):
        prepare_runtime_dir(tmp_path / "file")


def test_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    first = RuntimeLock(tmp_path)
    first.acquire()
    with pytest.raises(AlreadyRunning, match=f"pid {os.getpid()}"):
        RuntimeLock(tmp_path).acquire()
    first.release()
    again = RuntimeLock(tmp_path)
    again.acquire()
    again.release()


def test_remove_leftovers_only_touches_ours(tmp_path: Path) -> None:
    for name in ("control.sock", "decode-0.ipc", "model.safetensors"):
        (tmp_path / name).write_text("")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "counter_123.db").write_text("")
    removed = RuntimeLock(tmp_path).remove_leftovers()
    assert sorted(p.name for p in removed) == ["control.sock", "decode-0.ipc"]
    assert (tmp_path / "model.safetensors").exists()
    assert not (tmp_path / "metrics").exists()  # a new daemon's counters start from zero
