"""gpu_sharing.py: `--gpu-sharing mps` checks, the MPS control daemon's life around the
workers (a stand-in `nvidia-cuda-mps-control` on PATH that logs how it was called), and
the prefill process's share of the multiprocessors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmd import gpu_sharing
from lmd.config import ConfigError, ServeConfig
from lmd.gpu_sharing import (
    CONTROL,
    LOG_ENV,
    PIPE_ENV,
    SHARE_ENV,
    GpuSharingError,
    check_gpu_sharing,
    control_daemon,
    worker_share,
)
from lmd.protocol.roles import Role
from lmd.supervisor.model_check import check_engines

# Logs each call: its arguments, the pipe directory it was given, what came on stdin.
# `-d` exits with $FAKE_MPS_START_CODE (default 0), saying why when not 0; with
# $FAKE_MPS_HANG set it answers nothing for 5 s.
FAKE = """#!/bin/sh
[ -n "$FAKE_MPS_HANG" ] && sleep 5
input=$(cat)
echo "args=[$*] pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=[$input]" >> "$FAKE_MPS_LOG"
if [ "$1" = "-d" ] && [ "${FAKE_MPS_START_CODE:-0}" != 0 ]; then
    echo "An instance of this daemon is already running"
    exit "$FAKE_MPS_START_CODE"
fi
exit 0
"""


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in control program first on PATH; returns the file its calls go to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / CONTROL
    program.write_text(FAKE)
    program.chmod(0o755)
    log = tmp_path / "calls.txt"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    for key in (PIPE_ENV, LOG_ENV):
        monkeypatch.delenv(key, raising=False)
    return log


def mps_config(tmp_path: Path, **kw: object) -> ServeConfig:
    runtime = tmp_path / "run"
    runtime.mkdir(exist_ok=True)
    return ServeConfig(runtime_dir=runtime, gpu_sharing="mps", **kw)  # type: ignore[arg-type]


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_control_daemon_runs_while_the_workers_do(fake_control: Path, tmp_path: Path) -> None:
    config = mps_config(tmp_path)
    pipe = config.runtime_dir / "mps"
    with control_daemon(config):
        # what the workers spawned now inherit
        assert os.environ[PIPE_ENV] == str(pipe)
        assert os.environ[LOG_ENV] == str(config.runtime_dir / "mps-log")
        started = calls(fake_control)
        assert started == [
            f"args=[] pipe={pipe} stdin=[quit]",  # one a dead daemon may have left
            f"args=[-d] pipe={pipe} stdin=[]",
        ]
    assert calls(fake_control)[2:] == [f"args=[] pipe={pipe} stdin=[quit]"]
    assert PIPE_ENV not in os.environ and LOG_ENV not in os.environ
    assert pipe.is_dir() and (pipe.stat().st_mode & 0o777) == 0o700


def test_control_daemon_that_does_not_start_is_an_error(
    fake_control: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MPS_START_CODE", "1")
    daemon = control_daemon(mps_config(tmp_path))
    with pytest.raises(GpuSharingError, match="-d failed: An instance of this daemon"), daemon:
        pytest.fail("the workers must not start")
    assert PIPE_ENV not in os.environ


def test_a_control_program_that_hangs_is_an_error_at_start_and_a_warning_at_stop(
    fake_control: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(gpu_sharing, "CONTROL_TIMEOUT_S", 0.3)
    monkeypatch.setenv("FAKE_MPS_HANG", "1")
    with pytest.raises(GpuSharingError, match="timed out"), control_daemon(mps_config(tmp_path)):
        pytest.fail("the workers must not start")
    monkeypatch.delenv("FAKE_MPS_HANG")
    with control_daemon(mps_config(tmp_path)):
        monkeypatch.setenv("FAKE_MPS_HANG", "1")  # the quit at stop goes unanswered
    assert "MPS control daemon not stopped" in caplog.text
    assert PIPE_ENV not in os.environ  # the environment is restored all the same


def test_time_slice_runs_no_control_daemon(fake_control: Path, tmp_path: Path) -> None:
    with control_daemon(ServeConfig(runtime_dir=tmp_path)):
        assert PIPE_ENV not in os.environ
    assert calls(fake_control) == []


def test_check_refuses_mps_off_cuda_and_without_the_program(
    fake_control: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = mps_config(tmp_path)
    with pytest.raises(ConfigError, match="the engines run on cpu"):
        check_gpu_sharing(config, "cpu")
    check_gpu_sharing(config, "cuda")  # the stand-in is on PATH
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=f"needs {CONTROL} on PATH"):
        check_gpu_sharing(config, "cuda:0")
    check_gpu_sharing(ServeConfig(runtime_dir=tmp_path), "cpu")  # time-slice: nothing to check
    with pytest.raises(ConfigError, match="gpu_sharing: mps"):  # what lmdd serve runs first
        check_engines(config, "cpu")


def test_only_a_prefill_process_is_held_to_its_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SHARE_ENV, raising=False)
    config = mps_config(tmp_path, mps_prefill_percent=60)
    for role in (Role.DECODE, Role.TOKENIZER, Role.API):
        worker_share(config, role)
        assert SHARE_ENV not in os.environ
    worker_share(ServeConfig(runtime_dir=tmp_path), Role.PREFILL)
    assert SHARE_ENV not in os.environ
    worker_share(config, Role.PREFILL)
    assert os.environ[SHARE_ENV] == "60"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gpu_sharing": "mig"}, "'mig' is not one of time-slice, mps"),
        ({"gpu_sharing": "mps", "mode": "hybrid"}, "hybrid mode has one"),
        ({"mps_prefill_percent": 0}, "must be 1-100"),
        ({"mps_prefill_percent": 101}, "must be 1-100"),
    ],
)
def test_config_refuses(tmp_path: Path, fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServeConfig(runtime_dir=tmp_path, **fields)  # type: ignore[arg-type]
