"""Which Worker class runs each role.

tokenizer, prefill and decode are, for now, bare workers: real processes that start,
announce Ready, heartbeat, obey Drain/Stop and count what they drop, but serve no
requests yet (the engine and the OpenAI front are their own issues).
"""

from __future__ import annotations

from lmd.worker import Worker

ROLES = ("tokenizer", "prefill", "decode", "api")
ENGINE_ROLES = ("prefill", "decode")


def worker_class(role: str) -> type[Worker]:
    if role == "api":
        from lmd.api import ApiWorker  # only the api process needs FastAPI

        return ApiWorker
    if role in ROLES:
        return Worker
    raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
