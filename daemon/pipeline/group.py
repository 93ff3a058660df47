"""A pipeline's engine on a tensor-parallel group (`tp` > 1 in its engine config).

Ranks 1..N-1 are the daemon's rank processes (rank/), this process is rank 0, and the
engine is built as the daemon's hybrid worker builds its own (hybrid/loading.py): each
rank's part of its GPU's memory plan (or of the CPU cap), the split checked against the
model's heads first (a ValueError naming the sizes that would work).

A rank dies with the thread that spawned it (PR_SET_PDEATHSIG follows the thread), so a
thread of the group's own spawns the ranks and lives until `close()`: the caller's
thread may end, or run an event loop (a notebook), without taking the ranks with it.
A rank that dies fails what runs through the engine's next collective (at once on a CPU;
on CUDA at the group's timeout, startup_timeout) and the pipeline with it.
Spawned processes import the caller's main module: a script that makes a pipeline with
tp > 1 does so under `if __name__ == "__main__":`, as with any multiprocessing program.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from lmd.config import ServeConfig
from lmd.engine.engine import Engine
from lmd.engine.parallel import leave_group
from lmd.hybrid.loading import Loaded, load
from lmd.protocol import Role
from lmd.roles import worker_spec
from lmd.supervisor.model_check import check_tensor_parallel
from lmd.worker import WorkerStartError

if TYPE_CHECKING:
    from lmd.pipeline.config import EngineSettings

T = TypeVar("T")
SERVE_KEYS = frozenset(f.name for f in fields(ServeConfig))


class PipelineGroup:
    """The group and its engine; `close()` stops the ranks and frees what they held."""

    def __init__(
        self, model_dir: Path, settings: EngineSettings, device: str, backend: str
    ) -> None:
        engine = settings.engine_config()
        config = ServeConfig(
            runtime_dir=Path(tempfile.mkdtemp(prefix="lmd-pipeline-")),
            model=str(model_dir),
            mode="hybrid",
            device=device,
            dtype=settings.dtype,
            decode_backend=backend,
            tp=settings.tp,
            # The engine settings: the daemon's keys have their names (ServeConfig.engine_on).
            **{f.name: getattr(engine, f.name) for f in fields(engine) if f.name in SERVE_KEYS},
        )
        self.runtime_dir = config.runtime_dir
        self.loaded: Loaded | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="lmd-pipeline-group", daemon=True
        )
        self._thread.start()
        try:
            check_tensor_parallel(config)  # a ConfigError is a ValueError
            spec = worker_spec(config, Role.HYBRID, 0, device, os.getpid())
            try:
                self.loaded = self._run(load(spec, config, Role.HYBRID))
            except WorkerStartError as exc:
                raise RuntimeError(f"the pipeline's engine cannot start: {exc}") from None
        except BaseException:
            self.close()
            raise

    @property
    def engine(self) -> Engine:
        assert self.loaded is not None and isinstance(self.loaded.engine, Engine)
        return self.loaded.engine

    def ranks(self) -> list[dict[str, Any]]:
        """Ranks 1..N-1: rank, pid, device."""
        return [] if self.loaded is None or self.loaded.ranks is None else self.loaded.ranks.ranks()

    def close(self) -> None:
        """Stop the ranks, leave the group, end the group's thread (idempotent)."""
        if self.loaded is not None:
            loaded, self.loaded = self.loaded, None
            self._run(loaded.close())
            leave_group()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
