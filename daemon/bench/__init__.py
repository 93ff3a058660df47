"""`lmd-bench`: benchmarks whose figures go in docs/benchmarks.md.

    lmd-bench ipc       the internal wire path between two processes
    lmd-bench offline   the engine in-process on a fixed workload (optionally vs transformers)
    lmd-bench front     the serving path (api, tokenizer, engine loop) with a model-less engine
    lmd-bench migration KV blocks between two processes through lmd._native
    lmd-bench serve     TTFT/TPOT/ITL/E2E, throughput and goodput of any OpenAI server
    lmd-bench compare   several runs' JSON side by side (table, bar chart)
    lmd-bench plan      prefill:decode GPUs for a workload and its SLOs, by simulation

Output conventions, the same for every subcommand (the parser class adds the flags, so a
subcommand need not): a readable summary on stdout; `--json` prints one JSON line instead;
`--out FILE` writes that same JSON object to FILE (and the summary still prints). The JSON
records the exact command (API keys masked), the date, the versions and the host. A bad
argument or an unusable target is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from lmd import __version__
from lmd.bench import compare, front, ipc, migration, offline, plan, serve

SUBCOMMANDS = (ipc, offline, front, migration, serve, compare, plan)
SECRET_FLAGS = ("--api-key",)


class _SubcommandParser(argparse.ArgumentParser):
    """Every subcommand's parser: the shared output flags, which a subcommand may repeat."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["conflict_handler"] = "resolve"
        super().__init__(*args, **kwargs)
        self.add_argument("--json", action="store_true", help="print one JSON line")
        self.add_argument("--out", type=Path, help="also write the JSON to this file")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmd-bench", description="lmd benchmarks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def environment() -> dict[str, Any]:
    return {
        "lmd": __version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def command_line(argv: Sequence[str]) -> str:
    """`lmd-bench ARGS` with the values of secret flags masked."""
    words: list[str] = []
    for i, word in enumerate(argv):
        flag = word.partition("=")[0]
        if i > 0 and argv[i - 1] in SECRET_FLAGS:
            words.append("***")
        elif flag in SECRET_FLAGS and "=" in word:
            words.append(f"{flag}=***")
        else:
            words.append(word)
    return " ".join(["lmd-bench", *words])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    module = next(m for m in SUBCOMMANDS if m.__name__.endswith(f".{args.command}"))
    out: Path | None = args.out
    try:
        if out is not None and not out.parent.is_dir():  # before a run that may take hours
            raise ValueError(f"--out {out}: the directory {out.parent} does not exist")
        result = args.run(args)
    except ValueError as exc:
        print(f"lmd-bench {args.command}: {exc}", file=sys.stderr)
        return 2
    result["command"] = command_line(sys.argv[1:] if argv is None else argv)
    result["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    result["environment"] = environment()
    if out is not None:
        out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    if args.json:
        print(orjson.dumps(result).decode())
    else:
        print(module.summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
