"""`lmdd`: the daemon's command line.

lmdd serve [MODEL] [--host H] [--port P] [--runtime-dir DIR] ...
lmdd version
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from lmd import __version__
from lmd.config import BACKENDS, LOG_LEVELS, ConfigError, RestartPolicy, ServeConfig

log = logging.getLogger("lmd")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmdd", description="lmd serving daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    serve = sub.add_parser(
        "serve",
        help="run the daemon in the foreground",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = ServeConfig.__dataclass_fields__
    r = RestartPolicy.__dataclass_fields__
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    serve.add_argument("--model-name", help="name served in /v1/models (default: from MODEL)")
    serve.add_argument("--host", default=d["host"].default)
    serve.add_argument("--port", type=int, default=d["port"].default)
    serve.add_argument(
        "--runtime-dir",
        help="sockets and lock; default $RUNTIME_DIRECTORY, "
        "else $XDG_RUNTIME_DIR/lmd, else <tmp>/lmd-<uid>",
    )
    serve.add_argument("--device", default=d["device"].default, help="auto, cpu, cuda, cuda:N")
    serve.add_argument("--prefill-backend", default=d["prefill_backend"].default, choices=BACKENDS)
    serve.add_argument("--decode-backend", default=d["decode_backend"].default, choices=BACKENDS)
    serve.add_argument("--prefill-workers", type=int, default=d["prefill_workers"].default)
    serve.add_argument("--decode-workers", type=int, default=d["decode_workers"].default)
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=d["drain_timeout"].default,
        help="seconds to finish in-flight requests on SIGTERM",
    )
    serve.add_argument("--startup-timeout", type=float, default=d["startup_timeout"].default)
    serve.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=d["heartbeat_timeout"].default,
        help="seconds without a heartbeat before a worker is replaced",
    )
    serve.add_argument("--restart-backoff", type=float, default=r["backoff_s"].default)
    serve.add_argument(
        "--max-fast-failures",
        type=int,
        default=r["max_fast_failures"].default,
        help="young deaths in a row of one worker before the daemon gives up",
    )
    serve.add_argument("--log-level", default=d["log_level"].default, choices=LOG_LEVELS)
    return parser


def build_config(args: argparse.Namespace) -> ServeConfig:
    from lmd.paths import resolve_runtime_dir

    if args.model is not None and not os.path.exists(args.model):
        raise ConfigError(f"model: {args.model} does not exist")
    restart = RestartPolicy(
        backoff_s=args.restart_backoff, max_fast_failures=args.max_fast_failures
    )
    return ServeConfig(
        runtime_dir=resolve_runtime_dir(args.runtime_dir),
        model=args.model,
        model_name=args.model_name,
        host=args.host,
        port=args.port,
        device=args.device,
        prefill_backend=args.prefill_backend,
        decode_backend=args.decode_backend,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        drain_timeout=args.drain_timeout,
        startup_timeout=args.startup_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        log_level=args.log_level,
        restart=restart,
    )


def resolve_device(device: str) -> str:
    """`auto` is cuda when the CUDA driver reports a device, else cpu (with the reason)."""
    if device != "auto":
        return device
    from lmd import _native

    probe = _native.probe_cuda()
    if probe["available"]:
        return "cuda"
    log.info("no usable GPU (%s); running on cpu", probe["reason"])
    return "cpu"


def serve(args: argparse.Namespace) -> int:
    from lmd.paths import RuntimeDirError, prepare_runtime_dir
    from lmd.runtime_lock import AlreadyRunning
    from lmd.worker import configure_logging

    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"lmdd: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, "lmdd")
    try:
        prepare_runtime_dir(config.runtime_dir)
    except RuntimeDirError as exc:
        log.error("%s", exc)
        return 1

    import uvloop

    from lmd.supervisor import Supervisor

    supervisor = Supervisor(config, resolve_device(config.device), os.getpid())
    try:
        code: int = uvloop.run(supervisor.run())
    except AlreadyRunning as exc:
        log.error("%s", exc)
        return 1
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "version":
        print(f"lmdd {__version__}")
        return 0
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
