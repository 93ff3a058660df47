"""`lmdctl`: control a running lmdd over its Unix socket.

The global options (--socket, --json) go before the subcommand or after it, as with
kubectl and docker: `lmdctl --json status` and `lmdctl status --json` are the same.

Exit codes: 0 ok, 1 the daemon answered with an error, 2 bad usage,
3 the daemon is not running (as `systemctl status` does), 141 the reader of stdout went
away (`lmdctl status | head -1`): quietly, with the status a shell shows for coreutils
killed by SIGPIPE (128 + 13), so `set -o pipefail` scripts see it as `seq | head` does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import orjson

from lmd import __version__
from lmd.protocol.roles import SCALABLE_ROLES
from lmd_client import completion
from lmd_client.control import ControlClient, ControlRequestError, DaemonNotRunning
from lmd_client.metrics_view import metrics_text
from lmd_client.tables import duration, human_bytes, table

EXIT_OK, EXIT_ERROR, EXIT_NOT_RUNNING = 0, 1, 3
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # 141, as a shell reports `seq 9999999 | head -1`
MAX_INTERVAL_S = 60.0  # metrics --interval; the daemon's metrics_collect.MAX_INTERVAL_S


def workers_table(workers: list[dict[str, Any]]) -> str:
    now = time.time()
    rows = []
    for w in workers:
        kv = w.get("kv")
        rows.append(
            [
                w["name"],
                w["state"],
                str(w["pid"] or "-"),
                str(w["restarts"]),
                duration(now - w["started_at"] if w["started_at"] and w["pid"] else None),
                human_bytes(w["rss_bytes"]),
                w["backend"] or "-",
                w["device"] or "-",
                quantized(w),
                f"{kv['free_blocks']}/{kv['total_blocks']}" if kv else "-",
                str(w.get("num_dropped", 0)),
            ]
        )
    header = [
        "NAME",
        "STATE",
        "PID",
        "RESTARTS",
        "UPTIME",
        "RSS",
        "BACKEND",
        "DEVICE",
        "QUANT",
        "KV FREE",
        "DROPPED",
    ]
    return table(rows, header)


def quantized(worker: dict[str, Any]) -> str:
    """What an engine runs quantized: "w4a16 (awq, group 128) kv int8", or "-"."""
    parts = [worker.get("quantization") or ""]
    if worker.get("kv_cache_dtype") not in (None, "auto"):
        parts.append(f"kv {worker['kv_cache_dtype']}")
    return " ".join(p for p in parts if p) or "-"


def status_text(s: dict[str, Any]) -> str:
    head = (
        f"lmdd {s['version']} is {s['state']} (pid {s['pid']}, up "
        f"{duration(s['uptime_s'])})\n"
        f"model: {s['model']}   device: {s['device']}   runtime dir: {s['runtime_dir']}\n"
    )
    if s.get("num_dropped"):
        head += f"dropped malformed messages: {s['num_dropped']}\n"
    text = head + "\n" + workers_table(s["workers"])
    if any(w.get("memory") for w in s["workers"]):
        text += "\n\n" + memory_table(s["workers"])
    if any(w.get("ranks") for w in s["workers"]):
        text += "\n\n" + ranks_table(s["workers"])
    if "cluster" in s:
        text += "\n\n" + cluster_text(s["cluster"])
    return text


def memory_table(workers: list[dict[str, Any]]) -> str:
    """Each GPU engine's part of its device's memory plan; a tensor-parallel worker's
    ranks 1..N-1 on their own GPUs below it (their budgets and weights their own; the
    activations, graphs and KV as rank 0's, whose steps they replay on their shards)."""
    keys = ["budget", "weight", "activation", "graph", "kv"]
    rows = [
        [name, m["device"], human_bytes(m["device_total_bytes"])]
        + [human_bytes(m[f"{k}_bytes"]) for k in keys]
        + [str(m["kv_blocks"])]
        for w in workers
        if w.get("memory")
        for name, m in [
            (w["name"], w["memory"]),
            *((f"{w['name']}/r{r}", rm) for r, rm in enumerate(w.get("rank_memory", ()), 1)),
        ]
    ]
    header = ["WORKER", "GPU", "GPU TOTAL", "BUDGET", "WEIGHTS", "ACTIVATIONS", "GRAPHS"]
    return "memory plan:\n" + table(rows, [*header, "KV", "KV BLOCKS"])


def ranks_table(workers: list[dict[str, Any]]) -> str:
    """The processes of each tensor-parallel engine worker (rank 0 is the worker)."""
    rows = []
    for w in workers:
        # rank 0 is the worker itself; the others' memory comes with its heartbeats
        rss = [w.get("rss_bytes"), *(w.get("rank_rss_bytes") or ())]
        for r in w.get("ranks") or ():
            held = rss[r["rank"]] if r["rank"] < len(rss) else None
            rank = f"{r['rank']}/{w['tp']}"
            rows.append([w["name"], rank, str(r["pid"]), r["device"], human_bytes(held)])
    header = ["WORKER", "RANK", "PID", "DEVICE", "RSS"]
    return "tensor-parallel ranks:\n" + table(rows, header)


def cluster_text(c: dict[str, Any]) -> str:
    """Every node's workers, as this node's membership (etcd) knows them."""
    link = "connected" if c["connected"] else "NOT connected (the view may be stale)"
    head = f"cluster {c['etcd']}, {link}; this node: {c['node']}\n"
    rows = []
    for node in c["nodes"]:
        for w in node["workers"]:
            load = w.get("load") or {}
            rows.append(
                [
                    node["node"],
                    node["state"],
                    w["name"],
                    w["state"],
                    str(w["pid"] or "-"),
                    w.get("device") or "-",
                    w.get("endpoint") or "-",
                    str(load.get("queued_tokens", "-")),
                    f"{load['free_blocks']}/{w['total_blocks']}" if load else "-",
                ]
            )
    header = [
        "NODE",
        "NODE STATE",
        "WORKER",
        "STATE",
        "PID",
        "DEVICE",
        "ENDPOINT",
        "QUEUED",
        "KV FREE",
    ]
    return head + table(rows, header)


def _change(key: str, changes: dict[str, Any]) -> str:
    return f"{key} ({changes[key]['from']} -> {changes[key]['to']})"


def reload_text(r: dict[str, Any]) -> str:
    lines = [f"reloaded {r['file'] or '(no config file; environment only)'}"]
    if not r["changes"]:
        lines.append("nothing changed")
    if r["applied"]:
        lines.append("applied: " + ", ".join(_change(k, r["changes"]) for k in r["applied"]))
    if r["needs_restart"]:
        keys = ", ".join(_change(k, r["changes"]) for k in r["needs_restart"])
        lines.append(f"needs a restart: {keys}")
    return "\n".join(lines)


def config_text(c: dict[str, Any]) -> str:
    rows = [[k, "-" if v is None else str(v), c["origins"][k]] for k, v in c["values"].items()]
    text = f"config file: {c['file'] or '-'}\n\n" + table(rows, ["KEY", "VALUE", "FROM"])
    if c["needs_restart"]:
        pending = ", ".join(f"{k} = {v}" for k, v in c["needs_restart"].items())
        text += f"\n\nloaded by a reload, applied at the next restart: {pending}"
    return text


async def _run(args: argparse.Namespace) -> tuple[str, dict[str, Any] | list[Any]]:
    async with ControlClient(args.socket) as ctl:
        if args.command == "status":
            s = await ctl.status()
            return status_text(s), s
        if args.command == "workers":
            w = await ctl.workers()
            return workers_table(w), w
        if args.command == "restart":
            r = await ctl.restart(args.name)
            return f"restarting {args.name}", r
        if args.command == "scale":
            r = await ctl.scale(args.role, args.count)
            parts = [f"{args.role}: {args.count} workers"]
            parts += [f"starting {', '.join(r['added'])}"] if r["added"] else []
            parts += [f"retiring {', '.join(r['retiring'])} once idle"] if r["retiring"] else []
            return "; ".join(parts), r
        if args.command == "reload":
            r = await ctl.reload()
            return reload_text(r), r
        if args.command == "config":
            c = await ctl.config()
            return config_text(c), c
        if args.command == "metrics":
            m = await ctl.metrics(args.interval)
            return metrics_text(m), m
        if args.command == "version":
            s = await ctl.status()
            v = {"lmdctl": __version__, "lmdd": s["version"], "pid": s["pid"]}
            return f"lmdctl {__version__}\nlmdd {s['version']} (pid {s['pid']})", v
        reply = await getattr(ctl, args.command)()
        return f"{args.command}: daemon is now {reply['state']}", reply


def _interval(text: str) -> float:
    """--interval: seconds, > 0 and <= 60 (what the daemon accepts)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < seconds <= MAX_INTERVAL_S:
        raise argparse.ArgumentTypeError(f"{text} is not > 0 and <= {MAX_INTERVAL_S:g} s")
    return seconds


def _global_options(after_command: bool) -> argparse.ArgumentParser:
    """--socket and --json: on the main parser with their defaults, and on every
    subcommand without (SUPPRESS), so that one given after the subcommand is set and one
    given before it is not reset by the subcommand's parser."""
    options = argparse.ArgumentParser(
        add_help=False, argument_default=argparse.SUPPRESS if after_command else None
    )
    options.add_argument(
        "--socket",
        help="control socket (default $LMD_SOCKET, else the default runtime dir's control.sock)",
    )
    options.add_argument("--json", action="store_true", help="print the raw JSON reply")
    return options


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmdctl", description="control a running lmdd", parents=[_global_options(False)]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    after = [_global_options(True)]
    sub.add_parser("status", help="daemon state and every worker", parents=after)
    sub.add_parser("workers", help="the worker table", parents=after)
    restart = sub.add_parser("restart", help="restart one worker, e.g. decode-0", parents=after)
    restart.add_argument("name")
    scale = sub.add_parser("scale", help="add or remove prefill/decode workers live", parents=after)
    scale.add_argument("role", choices=[str(r) for r in SCALABLE_ROLES])
    scale.add_argument("count", type=int, help="workers of that role to run (1-64)")
    sub.add_parser(
        "drain", help="refuse new requests, finish in-flight ones, stay up", parents=after
    )
    sub.add_parser("resume", help="admit requests again after a drain", parents=after)
    sub.add_parser("shutdown", help="drain, then stop the daemon", parents=after)
    sub.add_parser(
        "reload",
        help="re-read the config file and LMD_* environment: apply the log level, "
        "list what needs a restart",
        parents=after,
    )
    sub.add_parser(
        "config", help="the effective config and where each value came from", parents=after
    )
    sub.add_parser("version", help="versions of lmdctl and of the running lmdd", parents=after)
    metrics = sub.add_parser(
        "metrics",
        help="tok/s, request rate, TTFT/TPOT/e2e p50/p99, running/waiting, KV use per "
        "engine worker, GPU memory and utilisation",
        parents=after,
    )
    metrics.add_argument(
        "--interval",
        type=_interval,
        default=1.0,
        help="seconds between the two scrapes that rates come from (default 1, at most 60)",
    )
    shell = sub.add_parser("completion", help="print a shell completion script (bash, zsh or fish)")
    shell.add_argument("shell", choices=completion.SHELLS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run lmdctl; a closed stdout (`lmdctl status | head -1`) ends it quietly with 141."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        # What is still buffered goes nowhere, so the exit's own flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "completion":  # needs no daemon
        sys.stdout.write(completion.script(args.shell, parser))
        return EXIT_OK
    try:
        text, reply = asyncio.run(_run(args))
    except DaemonNotRunning as exc:
        print(f"lmdctl: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except ControlRequestError as exc:
        print(f"lmdctl: {exc.message} ({exc.code})", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        sys.stdout.write(orjson.dumps(reply, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(text)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
