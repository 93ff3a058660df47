"""Which workers a daemon runs: a pure plan from its config (no process is imported).

Modes (tokenizer-0..T-1 with --tokenizer-workers T, api-0..A-1 with --api-workers A):
  disaggregated (default): tokenizer-0, prefill-0..K-1, decode-0..M-1, api-0; prefill
      workers compute prompts and migrate their KV to decode workers
      (lmd.prefill.worker, lmd.decode.worker; docs/architecture.md §1).
  hybrid: tokenizer-0, hybrid-0, api-0; hybrid-0 runs the whole engine (prefill and
      decode in one process, lmd.hybrid.worker): the smallest deployments, and the
      reference the disaggregated path is tested against.
A cluster node (`--cluster`) runs the disaggregated workers its `--roles` name.
Which class runs a role is spawn.py's: the entry point of a worker process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from lmd.config import ServeConfig
from lmd.names import worker_name
from lmd.protocol.roles import ENGINE_ROLES, Role


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker of the plan, as the supervisor spawns it (a plain dict on the way)."""

    name: str  # e.g. "decode-0"; also the DEALER identity and the inbox file name
    role: Role
    index: int
    supervisor_pid: int
    config: dict[str, Any]  # ServeConfig.to_dict()
    backend: str | None = None  # engine roles only
    device: str | None = None
    # GPU engines: the configured engine workers on the same GPU, itself included, as
    # (name, role): the memory plan shares the device between them (engine/memory_plan.py).
    # One that `lmdctl scale` adds is not among them: it takes what they leave.
    device_engines: tuple[tuple[str, str], ...] = ()
    tp: int = 1  # engine roles: processes in its tensor-parallel group (rank 0 is this one)
    # A group's ranks 1..tp-1: the engine ranks on each one's GPU, as device_engines.
    rank_engines: tuple[tuple[tuple[str, str], ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # a str from the dict form
        object.__setattr__(self, "device_engines", _pairs(self.device_engines))  # lists
        object.__setattr__(self, "rank_engines", tuple(map(_pairs, self.rank_engines)))

    def rank(self, rank: int) -> WorkerSpec:
        """Rank `rank` of this worker's group as the memory plan of its GPU sees it: its
        name there (rank_name), its device, the engines on that device."""
        if rank == 0:
            return self
        assert self.device is not None
        return dataclasses.replace(
            self,
            name=rank_name(self.name, rank),
            device=rank_devices(self.device, self.tp)[rank],
            device_engines=self.rank_engines[rank - 1] if self.rank_engines else (),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def role_counts(config: ServeConfig) -> dict[Role, int]:
    """How many workers of each role the daemon runs (a cluster node: its `roles`)."""
    if config.mode == "hybrid":
        return {
            Role.TOKENIZER: config.tokenizer_workers,
            Role.HYBRID: 1,
            Role.API: config.api_workers,
        }
    counts = {
        Role.TOKENIZER: config.tokenizer_workers,
        Role.PREFILL: config.prefill_workers,
        Role.DECODE: config.decode_workers,
        Role.API: config.api_workers,
    }
    return {r: n for r, n in counts.items() if not config.roles or r in config.roles}


def num_engine_workers(config: ServeConfig) -> int:
    counts = role_counts(config)
    return sum(counts.get(role, 0) for role in ENGINE_ROLES)


def worker_names(config: ServeConfig, role: Role) -> list[str]:
    count = role_counts(config).get(role, 0)
    return [worker_name(role, i, config.node) for i in range(count)]


def worker_spec(
    config: ServeConfig, role: Role, index: int, device: str, supervisor_pid: int
) -> WorkerSpec:
    """The spec of worker `index` of `role`; `device` is the daemon's, auto resolved."""
    backend = config.prefill_backend if role == Role.PREFILL else config.decode_backend
    own = config.role_device(role, device) if role.is_engine else None
    return WorkerSpec(
        name=worker_name(role, index, config.node),
        role=role,
        index=index,
        supervisor_pid=supervisor_pid,
        config=config.to_dict(),
        backend=backend if role.is_engine else None,
        device=own,
        device_engines=() if own is None else engines_on_gpu(config, device, own),
        tp=config.tp_of(role),
        rank_engines=()
        if own is None
        else tuple(
            engines_on_gpu(config, device, gpu) for gpu in rank_devices(own, config.tp_of(role))[1:]
        ),
    )


def _pairs(pairs: Any) -> tuple[tuple[str, str], ...]:
    return tuple((str(n), str(r)) for n, r in pairs)


def rank_name(worker: str, rank: int) -> str:
    """What a rank of a tensor-parallel group is called in its GPU's memory plan and
    ledger: the worker's name for rank 0, `<worker>.r<rank>` for the others."""
    return worker if rank == 0 else f"{worker}.r{rank}"


def rank_devices(device: str, size: int) -> list[str]:
    """The device of each rank of a group whose rank 0 is on `device`: cpu for all of
    them on CPU; on CUDA one GPU each, counting up from rank 0's (cuda:2 -> cuda:2,
    cuda:3)."""
    gpu = gpu_name(device)
    if gpu is None:
        return [device] * size
    first = int(gpu.split(":")[1])
    return [f"cuda:{first + rank}" for rank in range(size)]


def gpu_name(device: str) -> str | None:
    """`cuda:N` for a CUDA device (`cuda` is the current one, cuda:0 in a new process),
    None for the CPU."""
    if not device.startswith("cuda"):
        return None
    return device if ":" in device else "cuda:0"


def engines_on_gpu(config: ServeConfig, device: str, gpu: str) -> tuple[tuple[str, str], ...]:
    """The configured engine workers whose device is the GPU `gpu` ((name, role) pairs);
    `device` is the daemon's, auto resolved. A tensor-parallel group has a rank on each
    of its GPUs, by rank_name."""
    target = gpu_name(gpu)
    if target is None:
        return ()
    counts = role_counts(config)
    return tuple(
        (rank_name(worker_name(role, i, config.node), rank), str(role))
        for role in ENGINE_ROLES
        for rank, rank_device in enumerate(
            rank_devices(config.role_device(role, device), config.tp_of(role))
        )
        if gpu_name(rank_device) == target
        for i in range(counts.get(role, 0))
    )


def plan_workers(config: ServeConfig, device: str, supervisor_pid: int) -> list[WorkerSpec]:
    """The workers a daemon runs, in start order."""
    counts = role_counts(config)
    return [
        worker_spec(config, role, i, device, supervisor_pid)
        for role in Role
        for i in range(counts.get(role, 0))
    ]
