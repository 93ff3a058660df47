"""What a rank process of a tensor-parallel group is started with (a plain dict on the way)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

from lmd.config import ServeConfig
from lmd.ipc import Endpoints
from lmd.roles import WorkerSpec


@dataclass(frozen=True)
class RankSpec:
    """Rank `rank` (>= 1) of the group of engine worker `worker` (rank 0)."""

    worker: dict[str, Any]  # rank 0's WorkerSpec, as a dict
    rank: int
    model_dir: str  # resolved by rank 0 (model_source.resolve_model)
    transport: str | None  # its pool's migration transport; None: hybrid (no migration)
    leader_pid: int = 0  # rank 0's process, which it dies with

    @cached_property
    def group(self) -> WorkerSpec:
        """Rank 0's spec: the group's name, role, size, backend."""
        return WorkerSpec(**self.worker)

    @cached_property
    def own(self) -> WorkerSpec:
        """This rank as its GPU's memory plan sees it (WorkerSpec.rank): name, device."""
        return self.group.rank(self.rank)

    @cached_property
    def config(self) -> ServeConfig:
        return ServeConfig.from_dict(self.group.config)

    @property
    def name(self) -> str:
        """As logs and ps show it."""
        return f"{self.group.name} rank {self.rank}"

    @property
    def device(self) -> str:
        assert self.own.device is not None  # an engine's
        return self.own.device

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(self.config.runtime_dir)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
