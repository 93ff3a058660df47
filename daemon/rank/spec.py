"""What a rank process of a tensor-parallel group is started with (a plain dict on the way)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmd.ipc import Endpoints


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Rank `rank` (>= 1) of engine worker `worker`'s group of `size`."""

    worker: str  # the engine worker, rank 0: e.g. "decode-0"
    role: str
    rank: int
    size: int
    device: str
    model_dir: str  # resolved (model_source.resolve_model)
    backend: str  # as configured; the rank picks as rank 0 does (backends.select_backend)
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    transport: str | None  # its pool's migration transport; None: hybrid (no migration)
    runtime_dir: str
    leader_pid: int
    log_level: str
    join_timeout_s: float  # for the group's rendezvous and every collective after

    @property
    def name(self) -> str:
        """As logs and ps show it."""
        return f"{self.worker} rank {self.rank}"

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(Path(self.runtime_dir))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
