"""`lmdctl completion bash|zsh|fish`: scripts that parse, name every subcommand, and
complete as a user would see at the prompt (bash and fish are run for real)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from lmd_client import completion
from lmd_client.lmdctl import _parser, main

SUBCOMMANDS = sorted(completion.describe(_parser())[1], key=lambda c: c.name)
NAMES = [c.name for c in SUBCOMMANDS]
SYNTAX_CHECK = {"bash": ["bash", "-n"], "zsh": ["zsh", "-n"], "fish": ["fish", "--no-execute"]}


def script(shell: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["completion", shell]) == 0
    return capsys.readouterr().out


def test_the_parser_describes_every_subcommand() -> None:
    expected = {"status", "workers", "restart", "drain", "resume", "shutdown", "reload"}
    assert expected | {"config", "version", "metrics", "completion"} <= set(NAMES)
    by_name = {c.name: c for c in SUBCOMMANDS}
    assert by_name["restart"].positionals == [[completion.WORKERS]]
    assert by_name["completion"].positionals == [["bash", "zsh", "fish"]]
    assert any("--interval" in o.flags and o.takes_value for o in by_name["metrics"].options)


@pytest.mark.parametrize("shell", completion.SHELLS)
def test_script_names_every_subcommand_and_option(
    shell: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = script(shell, capsys)
    for name in NAMES:
        assert name in text, f"{shell} script misses {name}"
    for flag in ("socket", "json", "interval"):
        assert flag in text
    assert "--json workers" in text  # worker names come from the daemon


@pytest.mark.parametrize("shell", completion.SHELLS)
def test_script_parses(shell: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which(SYNTAX_CHECK[shell][0]) is None:
        pytest.skip(f"{shell} is not installed")
    path = tmp_path / f"lmdctl.{shell}"
    path.write_text(script(shell, capsys))
    out = subprocess.run(
        [*SYNTAX_CHECK[shell], str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr


def test_unknown_shell_is_refused() -> None:
    with pytest.raises(ValueError, match="bash, zsh, fish"):
        completion.script("tcsh", argparse.ArgumentParser())
    with pytest.raises(SystemExit) as exc:
        main(["completion", "tcsh"])
    assert exc.value.code == 2


@pytest.fixture
def fake_lmdctl(tmp_path: Path) -> Path:
    """An `lmdctl` on PATH that answers `--json workers` as a daemon would and logs its
    arguments to args.txt; one worker carries a nested "name" that is not a worker."""
    workers = [
        {"name": "tokenizer-0", "role": "tokenizer", "kv": None},
        {"name": "hybrid-0", "role": "hybrid", "kv": {"total_blocks": 8, "free_blocks": 8}},
        {"name": "api-0", "role": "api", "model": {"name": "not-a-worker"}},
    ]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "workers.json").write_bytes(orjson.dumps(workers, option=orjson.OPT_INDENT_2))
    fake = bin_dir / "lmdctl"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args.txt\ncat {tmp_path}/workers.json\n')
    fake.chmod(0o755)
    return tmp_path


def bash_complete(words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """COMPREPLY for the command line `words` (the last word is being completed)."""
    path = tmp_path / "lmdctl.bash"
    path.write_text(script("bash", capsys))
    line = " ".join(f"'{w}'" for w in words)
    program = (
        f"source {path}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _lmdctl; "
        'echo "${COMPREPLY[*]}"'
    )
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "-c", program], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_bash_completes_subcommands_options_and_choices(
    fake_lmdctl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bash_complete(["lmdctl", "re"], fake_lmdctl, capsys).split() == [
        "restart",
        "resume",
        "reload",
    ]
    assert bash_complete(["lmdctl", "--j"], fake_lmdctl, capsys) == "--json"
    assert bash_complete(["lmdctl", "metrics", "--in"], fake_lmdctl, capsys) == "--interval"
    assert bash_complete(["lmdctl", "completion", "z"], fake_lmdctl, capsys) == "zsh"
    assert bash_complete(["lmdctl", "metrics", "--interval", ""], fake_lmdctl, capsys) == ""


def test_bash_completes_worker_names_through_the_given_socket(
    fake_lmdctl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    words = ["lmdctl", "--socket", "/run/lmd/control.sock", "restart", ""]
    assert bash_complete(words, fake_lmdctl, capsys).split() == ["tokenizer-0", "hybrid-0", "api-0"]
    assert (fake_lmdctl / "args.txt").read_text().split() == [
        "--socket",
        "/run/lmd/control.sock",
        "--json",
        "workers",
    ]
    words = ["lmdctl", "restart", "h"]
    assert bash_complete(words, fake_lmdctl, capsys) == "hybrid-0"


def test_fish_completes_worker_names(fake_lmdctl: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("fish") is None:
        pytest.skip("fish is not installed")
    path = fake_lmdctl / "lmdctl.fish"
    path.write_text(script("fish", capsys))
    env = {**os.environ, "PATH": f"{fake_lmdctl / 'bin'}:{os.environ['PATH']}"}
    program = f"source {path}; complete -C 'lmdctl restart '; complete -C 'lmdctl sh'"
    out = subprocess.run(
        ["fish", "-c", program], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    words = [line.split("\t")[0] for line in out.stdout.splitlines()]
    assert sorted(words[:3]) == ["api-0", "hybrid-0", "tokenizer-0"]  # fish sorts them
    assert words[3:] == ["shutdown"]
