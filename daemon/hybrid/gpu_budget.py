"""A GPU engine's budget: its part of its device's memory plan (engine/memory_plan.py).

Every engine on a GPU computes the same plan for the engines configured there
(WorkerSpec.device_engines) from the model's checkpoint and config.json, and takes its
own part. The parts are noted in a ledger per device (`<runtime dir>/kv-pools/cuda:N/`,
pool_ledger.py), so that:
  - a restarted engine gets its part back (the others' entries leave it room);
  - an engine `lmdctl scale` adds (not in the configured plan) gets what the others'
    budgets leave, or a start-up error saying that nothing is left;
  - no two engines ever hold budgets that add up to more than the device may use.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmd.config import ServeConfig
from lmd.engine.backend import parse_dtype
from lmd.engine.config import EngineConfig, read_hf_config
from lmd.engine.memory_needs import engine_needs, weight_bytes
from lmd.engine.memory_plan import (
    Budget,
    EngineNeeds,
    MemoryPlanError,
    plan_device,
    remainder_budget,
)
from lmd.hybrid.pool_ledger import PoolLedger
from lmd.protocol.roles import Role
from lmd.roles import WorkerSpec, gpu_name

GiB = 1 << 30


def claim_gpu_budget(
    spec: WorkerSpec, config: ServeConfig, engine_config: EngineConfig, model_dir: Path
) -> tuple[Budget, PoolLedger]:
    """This engine's budget on its GPU, noted in the device's ledger (raises
    MemoryPlanError when the plan or what the device has left cannot hold it)."""
    gpu = gpu_name(spec.device or "")
    if gpu is None:
        raise ValueError(f"{spec.name} runs on {spec.device}, not a GPU")
    device = torch.device(gpu)
    _free, total = torch.cuda.mem_get_info(device)
    dtype = parse_dtype(config.dtype, device)
    hf_config = read_hf_config(model_dir)
    weights = weight_bytes(model_dir, dtype, engine_config.quantization)
    utilization = config.gpu_memory_utilization
    planned = dict(spec.device_engines)
    ledger = PoolLedger(config.runtime_dir, scope=gpu)

    def needs(name: str, role: Role) -> EngineNeeds:  # a rank's, in a group
        tp = config.tp_of(role)
        return engine_needs(
            name, role, hf_config, weights=weights, config=engine_config, dtype=dtype, tp=tp
        )

    def decide(taken: dict[str, int]) -> tuple[Budget, int]:
        held = sum(taken.values())
        if spec.name not in planned:  # added by lmdctl scale: what the others leave
            own = needs(spec.name, spec.role)
            budget = remainder_budget(gpu, total, own, held, utilization, num_others=len(taken))
        else:
            every = [needs(name, Role(role)) for name, role in planned.items()]
            budget = plan_device(gpu, total, every, utilization)[spec.name]
            usable = int(total * utilization)
            if held + budget.budget_bytes > usable:
                raise MemoryPlanError(
                    f"{spec.name}'s budget of {budget.budget_bytes / GiB:.2f} GiB does not "
                    f"fit: the other engines on {gpu} hold {held / GiB:.2f} of the "
                    f"{usable / GiB:.2f} GiB the daemon may use; scale one of them down"
                )
        return budget, budget.budget_bytes

    return ledger.claim_with(spec.name, decide), ledger
