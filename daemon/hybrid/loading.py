"""What an engine worker loads when it starts, and lets go when it stops.

`load(spec, config, role)`, in order:
  1. the model (model_source.resolve_model) and, for the disaggregated roles, the pool's
     memory as the migration transport shares it (migration/transports.py);
  2. with `tp` > 1, the other ranks of its tensor-parallel group (rank_group.py), which
     load their shards meanwhile;
  3. the memory the engine may take: on CPU its part of the daemon's cap
     (pool_ledger.py; a group's ranks share that part), on a GPU its budget of the
     device's plan (gpu_budget.py);
  4. the engine itself (Engine.build), its pool registered with the transport; on a
     CPU, disaggregated, its turns with the other role's engines (cpu_turns.py).
A failure is a WorkerStartError with one line (permanent when the memory plan cannot
hold the engine: a restart would fail the same way); a group already started is stopped.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmd.config import ServeConfig
from lmd.engine.backend import BackendError
from lmd.engine.engine import Engine
from lmd.engine.fixed_engine import FixedTokenEngine, FixedTokens
from lmd.engine.grammar import Grammars
from lmd.engine.memory_plan import Budget, MemoryPlanError
from lmd.engine.model_source import ModelSourceError, resolve_model
from lmd.engine.parallel import SINGLE
from lmd.engine.torch_backend.cpu_turns import SLOTS, CpuTurns
from lmd.hybrid.gpu_budget import claim_gpu_budget
from lmd.hybrid.pool_ledger import PoolLedger, claim_cpu_pool
from lmd.hybrid.rank_group import RankGroup, start_group
from lmd.migration.base import PoolMemory
from lmd.migration.transports import pool_memory
from lmd.protocol import Role
from lmd.roles import WorkerSpec, num_engine_workers
from lmd.worker import WorkerStartError


@dataclass(slots=True)
class Loaded:
    """An engine worker's engine and what it holds for it."""

    engine: Engine | FixedTokenEngine
    model_dir: Path
    memory: PoolMemory | None = None  # the pool as the migration transport shares it
    ranks: RankGroup | None = None  # the other ranks of a tensor-parallel group
    ledger: PoolLedger | None = None  # CPU pools: their share of the daemon's cap
    budget: Budget | None = None  # on a GPU: its part of the device's memory plan
    grammars: Grammars | None = None  # structured output (the fixed engine has none)
    name: str = ""

    async def close(self) -> None:
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.stop)
        if self.memory is not None:
            self.memory.close()
        if self.ledger is not None:
            self.ledger.remove(self.name)


async def load(
    spec: WorkerSpec, config: ServeConfig, role: Role, thread: Executor | None = None
) -> Loaded:
    """The worker's engine, built on `thread` (the thread that will step it: see
    step_thread.py), or a thread of asyncio's without one."""
    partial = _Partial()
    try:
        return await _load(spec, config, role, partial, thread)
    except (MemoryPlanError, ModelSourceError, BackendError, ValueError, OSError) as exc:
        await partial.stop()
        permanent = isinstance(exc, MemoryPlanError)  # the same on every restart
        raise WorkerStartError(f"{exc}{partial.cap_note}", permanent=permanent) from None
    except RuntimeError as exc:  # a rank of the group failed (RankError) among others
        await partial.stop()
        raise WorkerStartError(f"{exc}{partial.cap_note}") from None


@dataclass(slots=True)
class _Partial:
    """What a start that fails has to let go of, and why a CPU pool got less."""

    ranks: RankGroup | None = None
    cap_note: str = ""

    async def stop(self) -> None:
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.stop)


async def _load(
    spec: WorkerSpec, config: ServeConfig, role: Role, partial: _Partial, thread: Executor | None
) -> Loaded:
    device = spec.device or "cpu"
    engine_config = config.engine_on(spec.device)
    model = resolve_model(config.model)
    transport = None if role == Role.HYBRID else config.migration_transport
    memory = None if transport is None else pool_memory(device, transport)
    if spec.backend == "fixed":  # hybrid only (config.py)
        fixed = FixedTokenEngine(FixedTokens(model.path), engine_config)
        return Loaded(fixed, model.path, memory, name=spec.name)
    tp, ranks = SINGLE, None
    if spec.tp > 1:
        ranks, tp = await start_group(spec, config, model.path, device, transport, thread=thread)
        partial.ranks = ranks
    cpu_free, budget = None, None
    if device == "cpu":  # a group's pools share the engine's part
        ledger = PoolLedger(config.runtime_dir)
        cpu_free, partial.cap_note = claim_cpu_pool(ledger, spec.name, config, engine_config)
        cpu_free //= spec.tp
    else:
        budget, ledger = await asyncio.to_thread(
            claim_gpu_budget, spec, config, engine_config, model.path
        )
    loop = asyncio.get_running_loop()

    def on_thread(fn: Callable[..., Engine], *args: Any, **kwargs: Any) -> Awaitable[Engine]:
        return loop.run_in_executor(thread, functools.partial(fn, *args, **kwargs))

    build = on_thread if ranks is None else ranks.beside  # a rank may die meanwhile
    engine = await build(
        Engine.build,
        model.path,
        engine_config,
        device=device,
        dtype=config.dtype,
        backend=spec.backend or "auto",
        role=role,
        pool_buffer=None if memory is None else memory.buffer,
        cpu_engines=num_engine_workers(config),
        cpu_free=cpu_free,
        budget=budget,
        tp=tp,
        ranks=ranks,
    )
    if memory is not None:
        memory.attach(engine.pool)
    turns = device == "cpu" and role in (Role.PREFILL, Role.DECODE) and spec.index < SLOTS
    if turns:  # (past SLOTS engines of a role: even sharing)
        engine.backend.take_turns(CpuTurns(config.runtime_dir, role, spec.index))
    if budget is None:  # the CPU ledger: what this engine's pools hold, for engines added later
        ledger.record(spec.name, engine.pool.nbytes * spec.tp)
    vocab, eos = engine.backend.vocab_size, engine.backend.eos_token_ids
    grammars = Grammars(model.path, vocab, eos)
    return Loaded(engine, model.path, memory, ranks, ledger, budget, grammars, spec.name)
