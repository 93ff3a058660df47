"""How many intra-op threads a CPU forward uses: the cores other processes leave idle.

OpenMP regions wait for every thread of their team. With torch's default of one thread
per core and another process busy on one of the cores, each of the ~200 parallel regions
of a decode step waits for the thread the scheduler parked. On the 2-core dev machine
under load the offline batch-8 run took several times as long with two threads as with
one (docs/benchmarks.md, 'CPU, second pass: oneDNN linears, block copies, malloc,
threads', and 'Figures that code comments used to quote'). The prefill and decode
engines of one daemon on a CPU-only host contend for the cores the same way.

`CpuThreads.update()` runs before each forward, at most once per `interval_s`: from the
machine's busy time (/proc/stat) less this process's own CPU time it takes the cores the
other processes used over the last interval, and sets torch's thread count to the cores
left (at least 1, at most the count torch had when the backend was built). Idle cores
give back every thread; a process that may not run on every core keeps its count.
Disaggregated, the prefill and decode engines of a node take turns on its cores
(cpu_turns.py) and leave each other's time out of the count (`turns`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from lmd.engine.torch_backend.cpu_turns import CpuTurns

log = logging.getLogger(__name__)

PROC_STAT = Path("/proc/stat")
INTERVAL_S = 0.25
# A core counts as free when others used at most this much less than all of it over the
# interval: a thread on a core that is busy even a third of the time already stalls teams.
SLACK = 0.3


def machine_busy_seconds(stat: Path = PROC_STAT) -> float | None:
    """CPU seconds all cores have spent busy since boot (steal included), or None."""
    try:
        first = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(first) < 9 or first[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, first[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def threads_for(num_cpus: int, others: float, max_threads: int) -> int:
    """Threads to run when other processes used `others` cores (a mean) of `num_cpus`."""
    free = num_cpus - max(0.0, others)
    return max(1, min(max_threads, int(free + SLACK)))


class CpuThreads:
    """torch.set_num_threads from the load of other processes; call update() per step.

    Call it from the thread that runs the forward: OpenMP keeps the count per thread.
    """

    def __init__(self, interval_s: float = INTERVAL_S, stat: Path = PROC_STAT) -> None:
        self.interval_s = interval_s
        self.max_threads = torch.get_num_threads()
        self.threads = self.max_threads
        self._stat = stat
        num_cpus = os.cpu_count() or 1
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else num_cpus
        self.num_cpus = num_cpus
        busy = machine_busy_seconds(stat)
        # Only where the machine-wide figure describes the cores this process can use.
        self.enabled = busy is not None and affinity == num_cpus and self.max_threads > 1
        self._since = time.monotonic()
        self._busy = busy or 0.0
        self._mine = time.process_time()
        self.turns: CpuTurns | None = None  # the engines this one takes turns with
        self._theirs = 0.0

    def update(self) -> int:
        """Re-decide the thread count if an interval has passed; returns the count."""
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        wall = now - self._since
        if wall < self.interval_s:
            return self.threads
        busy, mine = machine_busy_seconds(self._stat), time.process_time()
        if busy is None:
            return self.threads
        theirs = self.turns.others_cpu_s() if self.turns is not None else 0.0
        taking_turns = max(0.0, theirs - self._theirs)  # (an engine that died: negative)
        others = (busy - self._busy - (mine - self._mine) - taking_turns) / wall  # cores
        self._since, self._busy, self._mine, self._theirs = now, busy, mine, theirs
        want = threads_for(self.num_cpus, others, self.max_threads)
        if want != self.threads:
            log.debug("torch threads %d -> %d (others used %.2f cores)", self.threads, want, others)
            torch.set_num_threads(want)
            self.threads = want
        return want
