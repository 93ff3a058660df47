"""Which Worker class runs each role.

tokenizer, prefill and decode are, for now, bare workers: real processes that start,
announce Ready, heartbeat, obey Drain/Stop and count what they drop, but serve no
requests yet (the engine and the OpenAI front are their own issues).
"""

from __future__ import annotations

from lmd.config import ServeConfig
from lmd.worker import Worker, WorkerSpec

ROLES = ("tokenizer", "prefill", "decode", "api")
ENGINE_ROLES = ("prefill", "decode")


def worker_class(role: str) -> type[Worker]:
    if role == "api":
        from lmd.api import ApiWorker  # only the api process needs FastAPI

        return ApiWorker
    if role in ROLES:
        return Worker
    raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")


def plan_workers(config: ServeConfig, device: str, supervisor_pid: int) -> list[WorkerSpec]:
    """The workers a daemon runs, in start order: tokenizer, prefill-*, decode-*, api."""
    counts = {
        "tokenizer": 1,
        "prefill": config.prefill_workers,
        "decode": config.decode_workers,
        "api": 1,
    }
    backends = {"prefill": config.prefill_backend, "decode": config.decode_backend}
    specs = []
    for role in ROLES:
        for i in range(counts[role]):
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
