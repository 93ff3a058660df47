"""lmdctl's command line: where global options may go, and a reader that goes away."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmd_client.lmdctl import EXIT_BROKEN_PIPE, EXIT_NOT_RUNNING, _parser, memory_table

LMDCTL = [sys.executable, "-m", "lmd_client.lmdctl"]
NO_DAEMON = "/nonexistent/lmd/control.sock"


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "--socket", "/s", "status"],
        ["status", "--json", "--socket", "/s"],  # as kubectl and docker take theirs
        ["--json", "status", "--socket", "/s"],
        ["--socket", "/elsewhere", "status", "--socket", "/s", "--json"],  # the last wins
    ],
)
def test_global_options_go_before_or_after_the_subcommand(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    assert (args.command, args.json, args.socket) == ("status", True, "/s")


def test_global_options_left_out_keep_their_defaults() -> None:
    for argv in (["status"], ["restart", "decode-0"], ["metrics", "--interval", "2"]):
        args = _parser().parse_args(argv)
        assert (args.json, args.socket) == (False, None)
    args = _parser().parse_args(["--json", "--socket", "/s", "restart", "decode-0"])
    assert (args.json, args.socket, args.name) == (True, "/s", "decode-0")


def test_an_option_after_the_subcommand_is_used() -> None:
    out = subprocess.run(
        [*LMDCTL, "status", "--json", "--socket", NO_DAEMON],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == EXIT_NOT_RUNNING, out.stderr  # not 2: usage was fine
    assert out.stderr == f"lmdctl: lmdd is not running (no answer on {NO_DAEMON})\n"


def closed_pipe_run(*args: str) -> subprocess.CompletedProcess[bytes]:
    """lmdctl ARGS with stdout a pipe whose reader is already gone (as after `| head -1`)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [*LMDCTL, *args], stdout=write, stderr=subprocess.PIPE, timeout=30, check=False
        )
    finally:
        os.close(write)


def test_a_closed_stdout_exits_141_without_a_traceback() -> None:
    out = closed_pipe_run("completion", "bash")  # needs no daemon; status: test_control.py
    assert out.stderr == b""
    assert out.returncode == EXIT_BROKEN_PIPE == 141


GIB = 1 << 30
MEMORY = {  # a GPU engine's part of its device's plan, as status carries it
    "device": "cuda:0",
    "device_total_bytes": 80 * GIB,
    "budget_bytes": 50 * GIB,
    "weight_bytes": 15 * GIB,
    "activation_bytes": 2 * GIB,
    "graph_bytes": GIB // 2,
    "kv_bytes": 30 * GIB,
    "kv_blocks": 3840,
}


def test_status_shows_each_gpu_engines_part_of_the_memory_plan() -> None:
    worker = {"name": "decode-0", "role": "decode", "state": "running", "memory": MEMORY}
    cpu = {"name": "api-0", "role": "api", "state": "running"}
    text = memory_table([worker, cpu])
    lines = text.splitlines()
    assert lines[0] == "memory plan:"
    assert lines[1].split() == [
        "WORKER", "GPU", "GPU", "TOTAL", "BUDGET", "WEIGHTS", "ACTIVATIONS", "GRAPHS", "KV",
        "KV", "BLOCKS",
    ]  # fmt: skip
    assert lines[2].split() == [
        "decode-0", "cuda:0", "80.0GiB", "50.0GiB", "15.0GiB", "2.0GiB", "512.0MiB", "30.0GiB",
        "3840",
    ]  # fmt: skip
    assert len(lines) == 3  # a worker without a GPU plan has no row


def test_a_tensor_parallel_workers_ranks_have_rows_for_their_gpus() -> None:
    """Rank 1's budget and weights are its own; the rest replays rank 0's steps."""
    rank = {**MEMORY, "device": "cuda:1", "budget_bytes": 49 * GIB, "weight_bytes": 14 * GIB}
    worker = {"name": "hybrid-0", "memory": MEMORY, "rank_memory": [rank]}
    lines = memory_table([worker]).splitlines()
    assert lines[2].split()[:2] == ["hybrid-0", "cuda:0"]
    assert lines[3].split() == [
        "hybrid-0/r1", "cuda:1", "80.0GiB", "49.0GiB", "14.0GiB", "2.0GiB", "512.0MiB",
        "30.0GiB", "3840",
    ]  # fmt: skip
