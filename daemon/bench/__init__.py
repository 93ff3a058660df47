"""`lmd-bench`: benchmarks whose figures go in docs/benchmarks.md.

    lmd-bench ipc       the internal wire path between two processes
    lmd-bench offline   the engine in-process on a fixed workload (optionally vs transformers)
    lmd-bench front     the serving path (api, tokenizer, engine loop) with a model-less engine

Every subcommand prints a readable summary, or one JSON line with --json that also
records the exact command, the versions and the device.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from lmd import __version__
from lmd.bench import front, ipc, offline

SUBCOMMANDS = (ipc, offline, front)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmd-bench", description="lmd benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def environment() -> dict[str, Any]:
    return {"lmd": __version__, "python": platform.python_version(), "host": platform.node()}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    module = next(m for m in SUBCOMMANDS if m.__name__.endswith(f".{args.command}"))
    try:
        result = args.run(args)
    except ValueError as exc:
        print(f"lmd-bench {args.command}: {exc}", file=sys.stderr)
        return 2
    result["command"] = " ".join(["lmd-bench", *(sys.argv[1:] if argv is None else argv)])
    result["environment"] = environment()
    if args.json:
        print(orjson.dumps(result).decode())
    else:
        print(module.summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
