"""A node's prefill and decode engines take turns on its CPU (cpu_turns.py): decode waits
for a prefill forward (bounded), prefill for the decode step under way (bounded), a slot
left by a dead process does not hold anyone, and each counts the other's CPU time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lmd.engine.torch_backend import cpu_turns
from lmd.engine.torch_backend.cpu_turns import CpuTurns
from lmd.protocol.roles import Role


def forward_in_a_thread(turns: CpuTurns, seconds: float, order: list[str]) -> threading.Thread:
    """A forward of `seconds` on another thread, under way when this returns; it appends
    "<role> done" to `order` at its end."""
    entered = threading.Event()

    def run() -> None:
        with turns.forward():
            entered.set()
            time.sleep(seconds)
            order.append(f"{turns.role} done")

    thread = threading.Thread(target=run)
    thread.start()
    entered.wait(5)
    return thread


def test_decode_waits_for_a_prefill_forward(tmp_path: Path) -> None:
    prefill, decode = CpuTurns(tmp_path, Role.PREFILL, 0), CpuTurns(tmp_path, Role.DECODE, 0)
    order: list[str] = []
    thread = forward_in_a_thread(prefill, 0.15, order)
    with decode.forward():
        order.append("decode runs")
    thread.join()
    assert order == ["prefill done", "decode runs"]
    assert decode.waited_s >= 0.1


def test_prefill_waits_for_the_decode_step_under_way(tmp_path: Path) -> None:
    prefill, decode = CpuTurns(tmp_path, Role.PREFILL, 1), CpuTurns(tmp_path, Role.DECODE, 2)
    order: list[str] = []
    thread = forward_in_a_thread(decode, 0.1, order)
    with prefill.forward():
        order.append("prefill runs")
    thread.join()
    assert order == ["decode done", "prefill runs"]


def test_waits_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream of prompts slows decode; it cannot stop it."""
    monkeypatch.setattr(cpu_turns, "MAX_WAIT_S", 0.05)
    prefill, decode = CpuTurns(tmp_path, Role.PREFILL, 0), CpuTurns(tmp_path, Role.DECODE, 0)
    with prefill.forward():
        start = time.monotonic()
        with decode.forward():
            assert 0.04 < time.monotonic() - start < 1.0


def test_a_forward_left_by_a_dead_process_is_cleared(tmp_path: Path) -> None:
    code = (
        "import os, sys; from pathlib import Path; from lmd.protocol.roles import Role; "
        "from lmd.engine.torch_backend.cpu_turns import CpuTurns; "
        "t = CpuTurns(Path(sys.argv[1]), Role.PREFILL, 3); t.forward().__enter__(); "
        "os._exit(0)"  # dies inside its forward
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    decode = CpuTurns(tmp_path, Role.DECODE, 0)
    with decode.forward():  # waits MAX_WAIT_S once, finds the dead pid, clears its slot
        pass
    start = time.monotonic()
    with decode.forward():
        assert time.monotonic() - start < cpu_turns.MAX_WAIT_S / 2


def test_each_counts_the_other_roles_cpu_time(tmp_path: Path) -> None:
    prefill = CpuTurns(tmp_path, Role.PREFILL, 0)
    assert prefill.others_cpu_s() == 0.0  # no decode engine yet
    decode = CpuTurns(tmp_path, Role.DECODE, 0)  # this process, as a decode engine
    burn = time.process_time() + 0.05
    while time.process_time() < burn:
        pass
    seen = prefill.others_cpu_s()
    assert seen >= 0.05 and seen == pytest.approx(sum(os.times()[:2]), abs=0.05)
    assert decode.others_cpu_s() == pytest.approx(seen, abs=0.05)  # prefill is us too


def test_only_engines_of_the_two_roles_take_turns(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="prefill and decode engines"):
        CpuTurns(tmp_path, Role.HYBRID, 0)
    with pytest.raises(ValueError, match="prefill and decode engines"):
        CpuTurns(tmp_path, Role.DECODE, cpu_turns.SLOTS)
