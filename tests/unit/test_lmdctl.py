"""lmdctl's command line: where global options may go, and a reader that goes away."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmd_client.lmdctl import EXIT_BROKEN_PIPE, EXIT_NOT_RUNNING, _parser

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
