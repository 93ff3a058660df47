"""The memory plan of one GPU: how much of it each engine process that runs there may hold.

Made before any engine allocates, from sizes every engine on the device computes alike
(the model's weight bytes from its checkpoint, an activation reserve per role from its
config.json: `memory_needs.py`), so the engines of a device agree on it without talking:

  usable = gpu_memory_utilization x the device's total memory
  fixed  = per engine: CONTEXT_BYTES (CUDA context and modules, outside torch's
           allocator) + weights + its activation reserve
  room   = usable - the sum of fixed                      (<= 0: MemoryPlanError)
  share  = the part of the room for one engine's KV pool:
           - prefill engines beside decode (or hybrid) engines get what their prompts in
             flight need (`kv_wanted`), together at most PREFILL_ROOM_CAP of the room;
           - the other engines split the rest evenly (an engine alone on its GPU: all);
  budget = fixed + share                                   (the sum is `usable`)

Each engine then sizes its pool inside its budget (`memory_profile.size_kv`):
cache_max_entry_count of its share (of the memory free after its weights, LMDeploy's
rule, for an engine alone on its GPU), and never more than the budget leaves after the
weights and the activation peak it measured. torch's allocator in that process is capped
at the budget (less the context), so one engine can never take another's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmd.protocol.roles import Role

GiB = 1 << 30
# Per process, memory the CUDA driver holds outside torch's allocator (the context, the
# loaded kernels of CUDA, cuBLAS and Triton): measured ~0.6 GiB on an H100 (CUDA 13).
CONTEXT_BYTES = GiB
# Prefill engines beside decode engines hold only the prompts in flight: together they
# take at most this part of a device's KV room; decode holds the running sequences.
PREFILL_ROOM_CAP = 0.25
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class MemoryPlanError(ValueError):
    """The engines planned on a device do not fit in what it may use."""


class StepOutOfMemory(Exception):
    """An allocation failed in a step (past the engine's memory plan). The engine aborted
    the step's requests (`request_ids`), freed their blocks, and can step on."""

    def __init__(self, request_ids: list[str], detail: str) -> None:
        super().__init__(f"out of GPU memory in a step of {len(request_ids)} requests: {detail}")
        self.request_ids = request_ids
        self.detail = detail


@dataclass(frozen=True, slots=True)
class EngineNeeds:
    """What one engine on a device needs before its KV pool."""

    name: str
    role: Role
    weight_bytes: int
    reserve_bytes: int  # activation peak + CUDA graphs + sampler, estimated
    kv_wanted: int | None = None  # prefill: the KV bytes its prompts in flight need


@dataclass(frozen=True, slots=True)
class Budget:
    """One engine's part of its device's memory."""

    name: str
    role: Role
    device: str
    total_bytes: int  # the device's memory
    budget_bytes: int  # everything this process may hold on the device
    weight_bytes: int
    reserve_bytes: int
    share_bytes: int  # the room for its KV pool, before cache_max_entry_count
    num_engines: int  # engines sharing the device (1: the GPU is its own)
    context_bytes: int = CONTEXT_BYTES

    @property
    def alone(self) -> bool:
        return self.num_engines == 1

    @property
    def allocator_bytes(self) -> int:
        """What torch's allocator in this process may hold: the budget less the context."""
        return max(0, self.budget_bytes - self.context_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "device_total_bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "planned_weight_bytes": self.weight_bytes,
            "planned_reserve_bytes": self.reserve_bytes,
            "share_bytes": self.share_bytes,
            "engines_on_device": self.num_engines,
        }


def plan_device(
    device: str,
    total_bytes: int,
    engines: Sequence[EngineNeeds],
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    *,
    context_bytes: int = CONTEXT_BYTES,
) -> dict[str, Budget]:
    """Each engine's budget on `device` (see the module doc); raises MemoryPlanError with
    the numbers when the engines' fixed needs leave no room for their KV pools."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if not engines:
        return {}
    usable = int(total_bytes * utilization)
    fixed = {e.name: context_bytes + e.weight_bytes + e.reserve_bytes for e in engines}
    room = usable - sum(fixed.values())
    if room <= 0:
        raise MemoryPlanError(_too_big(device, total_bytes, utilization, engines, context_bytes))
    shares = _shares(engines, room)
    return {
        e.name: Budget(
            name=e.name,
            role=e.role,
            device=device,
            total_bytes=total_bytes,
            budget_bytes=fixed[e.name] + shares[e.name],
            weight_bytes=e.weight_bytes,
            reserve_bytes=e.reserve_bytes,
            share_bytes=shares[e.name],
            num_engines=len(engines),
            context_bytes=context_bytes,
        )
        for e in engines
    }


def _shares(engines: Sequence[EngineNeeds], room: int) -> dict[str, int]:
    prefill = [e for e in engines if e.role == Role.PREFILL]
    others = [e for e in engines if e.role != Role.PREFILL]
    if not prefill or not others:  # one kind of engine on the device: even shares
        return {e.name: room // len(engines) for e in engines}
    cap = int(room * PREFILL_ROOM_CAP) // len(prefill)
    shares = {e.name: cap if e.kv_wanted is None else min(e.kv_wanted, cap) for e in prefill}
    rest = room - sum(shares.values())
    shares.update({e.name: rest // len(others) for e in others})
    return shares


def _too_big(
    device: str,
    total: int,
    utilization: float,
    engines: Sequence[EngineNeeds],
    context_bytes: int,
) -> str:
    weights = engines[0].weight_bytes
    needs = sum(context_bytes + e.weight_bytes + e.reserve_bytes for e in engines)
    return (
        f"{len(engines)} engine(s) on {device} need {needs / GiB:.1f} GiB before any KV "
        f"cache ({weights / GiB:.1f} GiB of weights each, plus activations and "
        f"{context_bytes / GiB:.1f} GiB of CUDA context) but --gpu-memory-utilization "
        f"{utilization:g} of its {total / GiB:.1f} GiB allows {total * utilization / GiB:.1f}; "
        "run fewer engines on it (--mode hybrid, or --prefill-device/--decode-device on "
        "other GPUs), lower --max-batch-size or --max-prefill-token-num, or raise "
        "--gpu-memory-utilization"
    )


def remainder_budget(
    device: str,
    total_bytes: int,
    needs: EngineNeeds,
    held_bytes: int,
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    *,
    num_others: int = 1,
    context_bytes: int = CONTEXT_BYTES,
) -> Budget:
    """The budget of an engine the configured plan did not count (one `lmdctl scale`
    added): what the budgets of the `num_others` engines already on the device
    (`held_bytes` together) leave."""
    usable = int(total_bytes * utilization)
    fixed = context_bytes + needs.weight_bytes + needs.reserve_bytes
    share = usable - held_bytes - fixed
    if share <= 0:
        raise MemoryPlanError(
            f"{needs.name} needs {fixed / GiB:.1f} GiB before any KV cache but the engines "
            f"on {device} hold {held_bytes / GiB:.1f} of the {usable / GiB:.1f} GiB that "
            f"--gpu-memory-utilization {utilization:g} allows; start the daemon with the "
            "workers it needs (--decode-workers, --prefill-workers) so that the plan shares "
            "the device between them"
        )
    return Budget(
        name=needs.name,
        role=needs.role,
        device=device,
        total_bytes=total_bytes,
        budget_bytes=fixed + share,
        weight_bytes=needs.weight_bytes,
        reserve_bytes=needs.reserve_bytes,
        share_bytes=share,
        num_engines=num_others + 1,
        context_bytes=context_bytes,
    )


def describe(memory: dict[str, Any]) -> str:
    """One engine's part of the plan on one line, for its log (memory_profile's report)."""
    gib = {k: v / GiB for k, v in memory.items() if k.endswith("_bytes")}
    return (
        f"{memory['device']}: budget {gib['budget_bytes']:.2f} of {gib['device_total_bytes']:.2f}"
        f" GiB ({memory['engines_on_device']} engine(s) on it): weights "
        f"{gib['weight_bytes']:.2f}, activations {gib['activation_bytes']:.2f}, CUDA graphs "
        f"{gib['graph_bytes']:.2f}, KV {gib['kv_bytes']:.2f} GiB in {memory['kv_blocks']} blocks"
    )
