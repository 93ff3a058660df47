"""The CPU KV pools of one daemon: who holds how many bytes, so their sum stays in the cap.

On CPU the KV pools of every engine worker of a daemon share one cap (kv_pool.
CPU_KV_CAP_BYTES). The workers started together split it evenly; one that `lmdctl scale`
adds later must see what the others already hold. Each engine worker notes its pool in
`<runtime dir>/kv-pools/<worker name>` ("<pid> <bytes>"), under an flock on
`kv-pools/.lock`:
  1. `claim(name, free_for)`: with the lock held, sum the pools of the other workers whose
     process is alive (a dead one's entry is stale: a kill -9 leaves it behind),
     compute this worker's free memory from it, and note the most its pool can take
     (`reserve`) before the lock is released, so that two workers starting at once
     never both count the same room;
  2. `record(name, nbytes)` once the pool exists: its real size;
  3. `remove(name)` when the worker stops.
A restarted worker (same name, new pid) overwrites its entry. The ledger lives and dies
with the runtime dir; a crashed daemon's stale entries name dead pids and are ignored.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import psutil

from lmd.config import ServeConfig
from lmd.engine.config import EngineConfig
from lmd.engine.kv_pool import CPU_KV_CAP_BYTES, cpu_kv_free
from lmd.roles import num_engine_workers

log = logging.getLogger(__name__)

LEDGER_DIR = "kv-pools"
T = TypeVar("T")


class PoolLedger:
    """The CPU pools' ledger, or with `scope` a GPU's (`cuda:N`: the memory budgets of the
    engines on it, hybrid/gpu_budget.py) in a directory of its own."""

    def __init__(self, runtime_dir: Path, scope: str = "") -> None:
        self.dir = Path(runtime_dir) / LEDGER_DIR / scope
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def claim(self, name: str, free_for: Callable[[int], int], fraction: float | None) -> int:
        """This worker's free memory, `free_for(bytes the other pools hold)`; notes
        `fraction` of it (cache_max_entry_count; None for a block count: all of it) as
        taken until `record` gives the pool's real size."""

        def decide(taken: dict[str, int]) -> tuple[int, int]:
            free = free_for(sum(taken.values()))
            if taken:
                held = ", ".join(f"{n} {b / 2**30:.2f} GiB" for n, b in sorted(taken.items()))
                log.info("CPU KV pools held by the other engines: %s", held)
            return free, free if fraction is None else int(free * fraction)

        return self.claim_with(name, decide)

    def claim_with(self, name: str, decide: Callable[[dict[str, int]], tuple[T, int]]) -> T:
        """`decide(the other live workers' bytes, by name)` -> (its answer, the bytes to
        note as this worker's), with the lock held throughout; returns the answer."""
        with self._locked():
            answer, nbytes = decide(self.taken(name))
            self._write(name, nbytes)
        return answer

    def record(self, name: str, nbytes: int) -> None:
        with self._locked():
            self._write(name, nbytes)

    def remove(self, name: str) -> None:
        with self._locked(), contextlib.suppress(FileNotFoundError):
            (self.dir / name).unlink()

    def taken(self, name: str) -> dict[str, int]:
        """Bytes of the pools of other workers that are alive, by worker name."""
        out: dict[str, int] = {}
        for path in self.dir.iterdir():
            if path.name == name or path.name.startswith("."):
                continue
            try:
                pid_text, nbytes_text = path.read_text().split()
                pid, nbytes = int(pid_text), int(nbytes_text)
            except (OSError, ValueError):
                continue  # being written, or not ours: not a pool
            if nbytes > 0 and psutil.pid_exists(pid):
                out[path.name] = nbytes
        return out

    def _write(self, name: str, nbytes: int) -> None:
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(f"{os.getpid()} {nbytes}\n")
        tmp.replace(self.dir / name)  # readers never see half an entry

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


def claim_cpu_pool(
    ledger: PoolLedger, name: str, config: ServeConfig, engine: EngineConfig
) -> tuple[int, str]:
    """The bytes engine worker `name`'s CPU pool may treat as free: its share of the
    daemon's cap, less what its other engines' pools hold (an engine added by lmdctl
    scale); and, when that is less than its share, why (for a start-up error)."""
    engines = num_engine_workers(config)
    available = psutil.virtual_memory().available
    entries = engine.cache_max_entry_count
    free = ledger.claim(
        name,
        lambda taken: cpu_kv_free(available, engines, taken),
        None if isinstance(entries, int) else entries,
    )
    if free >= cpu_kv_free(available, engines):
        return free, ""
    log.warning("%s: KV pool limited to %.2f GiB by the CPU cap", name, free / 2**30)
    note = (
        f" (the other engines' KV pools leave {free / 2**30:.2f} GiB of the "
        f"{CPU_KV_CAP_BYTES / 2**30:.0f} GiB CPU cap; scale one down first)"
    )
    return free, note
