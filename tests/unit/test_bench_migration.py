"""`lmd-bench migration`: two real processes, the JSON keys the issue names."""

from __future__ import annotations

import orjson
import pytest

from lmd.bench import main
from lmd.migration import nixl
from lmd.migration.native import available_transports


def test_host_migration_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["migration", "--size-mb", "4", "--block-kb", "64", "--repeats", "2", "--json"]) == 0
    )
    result = orjson.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["transport"] == "host"
    assert result["bytes"] == 4 << 20 and result["blocks"] == 64
    assert result["seconds"] > 0 and result["gbps"] > 0 and result["memcpy_gbps"] > 0
    assert result["command"].startswith("lmd-bench migration")


def test_summary_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migration", "--size-mb", "1", "--block-kb", "128", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "host cpu -> cpu" in out and "8 blocks" in out and "memcpy" in out


@pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed (lmd[cluster])")
def test_nixl_migration_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["migration", "--transport", "nixl", "--size-mb", "4", "--block-kb", "64"]
    assert main([*argv, "--repeats", "2", "--json"]) == 0
    result = orjson.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["transport"] == "nixl" and result["src_device"] == "cpu"
    assert result["bytes"] == 4 << 20 and result["blocks"] == 64 and result["gbps"] > 0


@pytest.mark.skipif("cuda_ipc" in available_transports(), reason="this machine has CUDA")
def test_cuda_ipc_without_a_gpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migration", "--transport", "cuda_ipc", "--size-mb", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmd-bench migration: cuda_ipc needs a GPU") and err.count("\n") == 1


def test_devices_with_the_host_transport_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migration", "--dst-device", "cuda:1"]) == 2
    assert "host transport moves cpu memory" in capsys.readouterr().err
