"""glibc keeps freed activations in the process (engine/torch_backend/host_memory.py)."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from lmd.engine.torch_backend.host_memory import keep_freed_memory


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux's")
def test_freed_activations_are_reused_without_page_faults() -> None:
    assert keep_freed_memory()
    assert keep_freed_memory()  # setting it again is harmless
    for _ in range(3):  # 8 MiB, written: glibc's default would mmap it anew every time
        torch.ones(2 << 20)  # (the first rounds grow the heap once)
    before = minor_faults()
    for _ in range(10):
        torch.ones(2 << 20)
    # Default glibc: ~2,048 faults (one per 4 KiB page) per round, ~20,000 in all.
    assert minor_faults() - before < 2_000
