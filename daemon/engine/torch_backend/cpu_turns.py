"""Prompts first on a CPU: a node's prefill and decode engines take turns on its cores.

Disaggregated on a CPU, the two engines share the node's cores. Shared evenly (a thread
each, cpu_threads.py), a prompt computed on one core while decode held the other, and
while prompts waited half the sequences were out of the decode batch: on two cores,
served at concurrency 8, 1.79x transformers' batch-8 `generate` against 2.44x for the
one engine of hybrid mode (docs/benchmarks.md, "CPU, sixth pass").

So the engines take turns, prompts first: a decode engine's forward waits while a
prefill engine of its node runs one (at most MAX_WAIT_S a step: a stream of prompts
slows decode, it cannot stop it), and a prefill engine's forward waits for the decode
step under way to end (at most one step, PREFILL_WAIT_S). Neither counts the other's
CPU time among what other processes use (cpu_threads.py), so each forward runs a thread
on every core the rest of the host leaves. Only lmd's own engines wait for each other;
any other process keeps its share of the host as before.

The engines meet in a file of the runtime directory (`cpu-turns`), mapped by each: per
role, a slot per engine holding its pid while it runs a forward (0 otherwise), and one
holding its pid while it lives. A forward's slot left by a process that died is cleared
by the engine that finds it. The torch backend's engines take turns; a tensor-parallel
group's (GroupBackend) do not.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from lmd.protocol.roles import Role

SLOTS = 64  # engines of a role on one node
FILE_NAME = "cpu-turns"
MAX_WAIT_S = 0.5
PREFILL_WAIT_S = 0.2
POLL_S = 0.001


class CpuTurns:
    """This engine's side of the node's turns: `role` prefill or decode, `index` its
    worker index (< SLOTS)."""

    def __init__(self, runtime_dir: Path, role: Role, index: int) -> None:
        if role not in (Role.PREFILL, Role.DECODE) or not 0 <= index < SLOTS:
            raise ValueError(f"CPU turns are for prefill and decode engines 0..{SLOTS - 1}")
        self.role, self.index, self.pid = role, index, os.getpid()
        size = 4 * SLOTS * 8
        fd = os.open(runtime_dir / FILE_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zeros; every opener asks the same size
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # int64 words, SLOTS a block: prefill's and decode's forwards, their engines' pids
        words = memoryview(self._map).cast("q")
        blocks = [words[i * SLOTS : (i + 1) * SLOTS] for i in range(4)]
        forwards, pids = blocks[:2], blocks[2:]  # each [prefill's, decode's]
        me = 0 if role == Role.PREFILL else 1
        self._mine, self._theirs, self._their_pids = forwards[me], forwards[1 - me], pids[1 - me]
        self._mine[index] = 0  # a predecessor of ours may have died mid-forward
        pids[me][index] = self.pid
        self.waited_s = 0.0  # time this engine spent waiting for the other role, in all

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around a forward. Prefill: marked, after the decode step under way (at most
        PREFILL_WAIT_S). Decode: after the prefill engines' forwards (at most
        MAX_WAIT_S), then marked."""
        if self.role == Role.PREFILL:
            self._mine[self.index] = self.pid  # first: no decode step starts after this
            self._wait(PREFILL_WAIT_S)
        else:
            self._wait(MAX_WAIT_S)
            self._mine[self.index] = self.pid
        try:
            yield
        finally:
            self._mine[self.index] = 0

    def _wait(self, limit_s: float) -> None:
        """Until no engine of the other role runs a forward, `limit_s` at most."""
        start = time.monotonic()
        deadline = start + limit_s
        while any(self._theirs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if any(self._theirs):  # the deadline: is a slot left by a dead process?
            for slot, pid in enumerate(self._theirs):
                if pid and not psutil.pid_exists(pid):
                    self._theirs[slot] = 0
        self.waited_s += time.monotonic() - start

    def others_cpu_s(self) -> float:
        """CPU seconds the node's engines of the other role (live ones) have used since
        they started: what this engine leaves out of the others' load (cpu_threads)."""
        return sum(_cpu_s(pid) for pid in self._their_pids if pid)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads); 0 if it is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)
