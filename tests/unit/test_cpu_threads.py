"""The CPU engine's thread count follows the cores other processes leave idle."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmd.engine.torch_backend.cpu_threads import CpuThreads, machine_busy_seconds, threads_for

HZ = os.sysconf("SC_CLK_TCK")


class FakeStat:
    """A /proc/stat whose busy time we advance by hand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.busy_ticks = 1000
        self.write()

    def write(self) -> None:
        # cpu user nice system idle iowait irq softirq steal guest guest_nice
        self.path.write_text(f"cpu  {self.busy_ticks} 0 0 50000 0 0 0 0 0 0\ncpu0 1 0 0 1\n")

    def add_busy(self, seconds: float) -> None:
        self.busy_ticks += round(seconds * HZ)
        self.write()


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """A thread per core for the test (an engine run earlier in this process may have
    left torch at one, which disables CpuThreads), and the count as it was after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(threads)


def test_threads_for_keeps_a_thread_per_idle_core() -> None:
    assert threads_for(2, 0.0, 2) == 2
    assert threads_for(2, 0.2, 2) == 2  # a little background work
    assert threads_for(2, 0.5, 2) == 1  # a core half busy: its thread would stall teams
    assert threads_for(2, 1.9, 2) == 1  # never fewer than one
    assert threads_for(16, 3.0, 16) == 13
    assert threads_for(16, 0.0, 8) == 8  # never more than torch started with


def test_machine_busy_seconds_reads_proc_stat(tmp_path: Path) -> None:
    stat = FakeStat(tmp_path / "stat")
    assert machine_busy_seconds(stat.path) == pytest.approx(1000 / HZ)
    assert machine_busy_seconds(tmp_path / "missing") is None
    (tmp_path / "odd").write_text("intr 1 2 3\n")
    assert machine_busy_seconds(tmp_path / "odd") is None
    if Path("/proc/stat").exists():
        assert (machine_busy_seconds() or 0.0) > 0.0


@pytest.mark.usefixtures("restore_threads")
def test_threads_drop_while_others_are_busy_and_come_back(tmp_path: Path) -> None:
    stat = FakeStat(tmp_path / "stat")
    threads = CpuThreads(interval_s=0.05, stat=stat.path)
    if not threads.enabled or threads.num_cpus < 2:
        pytest.skip("needs two or more cores this process may use")
    assert threads.update() == threads.max_threads  # within the first interval: unchanged
    time.sleep(0.1)
    stat.add_busy(0.1 * threads.num_cpus)  # others kept every core busy
    assert threads.update() == 1
    assert torch.get_num_threads() == 1
    time.sleep(0.1)  # others went quiet
    assert threads.update() == threads.max_threads
    assert torch.get_num_threads() == threads.max_threads


def test_disabled_without_proc_stat(tmp_path: Path) -> None:
    threads = CpuThreads(interval_s=0.0, stat=tmp_path / "missing")
    assert not threads.enabled
    assert threads.update() == threads.max_threads


class FakeTurns:
    """The other role's engines, whose CPU time we advance by hand (cpu_turns.py)."""

    def __init__(self) -> None:
        self.seconds = 5.0

    def others_cpu_s(self) -> float:
        return self.seconds


@pytest.mark.usefixtures("restore_threads")
def test_the_engine_taking_turns_is_not_counted(tmp_path: Path) -> None:
    """The other role's engine waits while this one computes: its time takes no thread."""
    stat = FakeStat(tmp_path / "stat")
    threads = CpuThreads(interval_s=0.05, stat=stat.path)
    if not threads.enabled or threads.num_cpus < 2:
        pytest.skip("needs two or more cores this process may use")
    turns = FakeTurns()
    threads.turns = turns  # type: ignore[assignment]  # CpuTurns' one method used here
    threads.update()
    time.sleep(0.1)
    busy = 0.1 * threads.num_cpus
    stat.add_busy(busy)  # every core busy, all of it the other engine's
    turns.seconds += busy
    assert threads.update() == threads.max_threads
    time.sleep(0.1)
    stat.add_busy(busy)  # every core busy, none of it the other engine's
    assert threads.update() == 1
