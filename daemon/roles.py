"""Which workers a daemon runs, and which Worker class runs each role.

Modes:
  hybrid (default until KV migration lands): tokenizer-0, hybrid-0, api-0; hybrid-0
      runs the whole engine (prefill and decode in one process, lmd.engine.worker).
  disaggregated: tokenizer-0, prefill-0..K-1, decode-0..M-1, api-0. Until KV migration
      lands, prefill and decode are bare workers: real processes that start, announce
      Ready, heartbeat, obey Drain/Stop and count what they drop, but serve nothing; the
      tokenizer answers every request with a clear 503 saying so.
"""

from __future__ import annotations

from lmd.config import ServeConfig
from lmd.worker import Worker, WorkerSpec

ROLES = ("tokenizer", "prefill", "decode", "hybrid", "api")
ENGINE_ROLES = ("prefill", "decode", "hybrid")


def worker_class(role: str) -> type[Worker]:
    if role == "api":
        from lmd.api import ApiWorker  # only the api process needs FastAPI

        return ApiWorker
    if role == "tokenizer":
        from lmd.tokenizer import TokenizerWorker

        return TokenizerWorker
    if role == "hybrid":
        from lmd.engine.worker import EngineWorker  # only engines import torch

        return EngineWorker
    if role in ROLES:
        return Worker
    raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")


def plan_workers(config: ServeConfig, device: str, supervisor_pid: int) -> list[WorkerSpec]:
    """The workers a daemon runs, in start order."""
    if config.mode == "hybrid":
        counts = {"tokenizer": 1, "hybrid": 1, "api": 1}
    else:
        counts = {
            "tokenizer": 1,
            "prefill": config.prefill_workers,
            "decode": config.decode_workers,
            "api": 1,
        }
    backends = {
        "prefill": config.prefill_backend,
        "decode": config.decode_backend,
        "hybrid": config.decode_backend,
    }
    specs = []
    for role in ROLES:
        for i in range(counts.get(role, 0)):
            engine = role in ENGINE_ROLES
            spec = WorkerSpec(
                name=f"{role}-{i}",
                role=role,
                index=i,
                supervisor_pid=supervisor_pid,
                config=config.to_dict(),
                backend=backends[role] if engine else None,
                device=device if engine else None,
            )
            specs.append(spec)
    return specs
