"""Which workers a daemon runs, and which Worker class runs each role.

Modes:
  disaggregated (default): tokenizer-0, prefill-0..K-1, decode-0..M-1, api-0; prefill
      workers compute prompts and migrate their KV to decode workers
      (lmd.prefill.worker, lmd.decode.worker; ARCHITECTURE §4).
  hybrid: tokenizer-0, hybrid-0, api-0; hybrid-0 runs the whole engine (prefill and
      decode in one process, lmd.hybrid.worker): the smallest deployments, and the
      reference the disaggregated path is tested against.
"""

from __future__ import annotations

from lmd.config import ServeConfig
from lmd.names import worker_name
from lmd.worker import Worker, WorkerSpec

ROLES = ("tokenizer", "prefill", "decode", "hybrid", "api")
ENGINE_ROLES = ("prefill", "decode", "hybrid")


def worker_class(role: str) -> type[Worker]:
    if role == "api":
        from lmd.api.worker import ApiWorker  # only the api process needs FastAPI

        return ApiWorker
    if role == "tokenizer":
        from lmd.tokenizer.worker import TokenizerWorker

        return TokenizerWorker
    if role == "hybrid":
        from lmd.hybrid.worker import EngineWorker  # only engines import torch

        return EngineWorker
    if role == "prefill":
        from lmd.prefill.worker import PrefillWorker

        return PrefillWorker
    if role == "decode":
        from lmd.decode.worker import DecodeWorker

        return DecodeWorker
    raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")


def role_counts(config: ServeConfig) -> dict[str, int]:
    """How many workers of each role the daemon runs (a cluster node: its `roles`)."""
    if config.mode == "hybrid":
        return {"tokenizer": 1, "hybrid": 1, "api": 1}
    counts = {
        "tokenizer": 1,
        "prefill": config.prefill_workers,
        "decode": config.decode_workers,
        "api": 1,
    }
    return {r: n for r, n in counts.items() if not config.roles or r in config.roles}


def worker_names(config: ServeConfig, role: str) -> list[str]:
    count = role_counts(config).get(role, 0)
    return [worker_name(role, i, config.node) for i in range(count)]


def plan_workers(config: ServeConfig, device: str, supervisor_pid: int) -> list[WorkerSpec]:
    """The workers a daemon runs, in start order."""
    counts = role_counts(config)
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
                name=worker_name(role, i, config.node),
                role=role,
                index=i,
                supervisor_pid=supervisor_pid,
                config=config.to_dict(),
                backend=backends[role] if engine else None,
                device=config.role_device(role, device) if engine else None,
            )
            specs.append(spec)
    return specs
