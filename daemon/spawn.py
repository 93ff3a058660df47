"""The entry point of a worker process, and which class runs each role.

The supervisor spawns `worker_main` (multiprocessing's spawn context) with a WorkerSpec
as a plain dict; the process first renames itself `lmd: <worker name>` (process_title).
Only here does a role meet its process class, imported on demand: the api alone needs
FastAPI, the engine roles alone need torch.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import uvloop
from setproctitle import setproctitle

from lmd.config import ServeConfig
from lmd.gpu_sharing import worker_share
from lmd.parent import die_with_parent, exit_without_teardown
from lmd.protocol.roles import Role
from lmd.roles import WorkerSpec
from lmd.worker import Worker, configure_logging


def worker_class(role: Role) -> type[Worker]:
    if role == Role.API:
        from lmd.api.worker import ApiWorker

        return ApiWorker
    if role == Role.TOKENIZER:
        from lmd.tokenizer.worker import TokenizerWorker

        return TokenizerWorker
    if role == Role.HYBRID:
        from lmd.hybrid.worker import EngineWorker

        return EngineWorker
    if role == Role.PREFILL:
        from lmd.prefill.worker import PrefillWorker

        return PrefillWorker
    from lmd.decode.worker import DecodeWorker

    return DecodeWorker


def process_title(name: str) -> str:
    """What ps, top and /proc/PID/cmdline show for process `name` (a worker, "supervisor")."""
    return f"lmd: {name}"


def worker_main(spec_dict: dict[str, Any]) -> None:
    """Entry point of a spawned worker process."""
    setproctitle(process_title(spec_dict["name"]))  # first: ps and top show it from here on
    spec = WorkerSpec(**spec_dict)
    die_with_parent(spec.supervisor_pid)
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor only; it drains us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = ServeConfig.from_dict(spec.config)
    worker_share(config, spec.role)  # before anything starts CUDA
    configure_logging(config.log_level, spec.name)
    worker = worker_class(spec.role)(spec, config)
    code: int = uvloop.run(worker.run())
    exit_without_teardown(code, run_atexit=spec.tp == 1)  # tp > 1: rank 0 of a group
