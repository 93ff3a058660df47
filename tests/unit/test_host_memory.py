"""glibc keeps freed activations in the process (engine/torch_backend/host_memory.py).

Measured in fresh interpreters, as a worker process starts, with the setting and
without: a 24 MiB activation comes from the heap, where a freed one stays for the next,
not from a fresh mmap whose every page faults in again as glibc's default serves it. (In
the test runner's own process, what earlier tests did to its heap and glibc's rising
thresholds decide it. Whether the next activation lands on the freed pages depends on
what else the interpreter allocated in between: not asserted.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

FRESH_PROCESS = """
import resource
import sys

import torch

from lmd.engine.torch_backend.host_memory import keep_freed_memory

if sys.argv[1] == "keep":
    assert keep_freed_memory()
    assert keep_freed_memory()  # setting it again is harmless
x = torch.ones(24 << 18)  # 24 MiB, written
address = x.data_ptr()
del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
y = torch.ones(24 << 18)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
with open("/proc/self/maps") as maps:
    heap = [line.split()[0] for line in maps if line.rstrip().endswith("[heap]")]
low, high = (int(end, 16) for end in heap[0].split("-")) if heap else (0, 0)
print(int(low <= address < high), faults)
"""


def first_activation(setting: str) -> tuple[bool, int]:
    """(whether a fresh process's first 24 MiB activation lay in its heap, the page
    faults of the next one, made after the first was freed)."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, setting],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    in_heap, faults = done.stdout.split()[-2:]
    return in_heap == "1", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux's")
def test_activations_come_from_the_heap_not_from_fresh_mmaps() -> None:
    assert first_activation("keep")[0]
    in_heap, faults = first_activation("default")  # glibc's own: a fresh mmap each time
    assert not in_heap and faults > 5_000  # one per 4 KiB page of the next one
