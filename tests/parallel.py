"""Tensor-parallel groups for tests: N processes joined over gloo on the CPU, or over
NCCL with rank r on cuda:r.

`run_group(size, fn, *args)` spawns `size` processes, each joining one group
(engine/parallel.py) and calling `fn(tp, *args)`; it returns every rank's result, in rank
order. `fn` must be importable (module level) and return something picklable (numpy
arrays, not tensors: torch's shared-memory hand-off does not outlive the process).
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

GROUP_TIMEOUT_S = 120.0


def _rank(  # noqa: PLR0917  (multiprocessing passes them positionally)
    rank: int,
    size: int,
    rendezvous: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    cuda: bool,
) -> None:
    import torch

    from lmd.engine.parallel import join_group, leave_group

    try:
        torch.set_num_threads(1)
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        tp = join_group(rank, size, Path(rendezvous), device, GROUP_TIMEOUT_S)
        results.put((rank, True, fn(tp, *args)))
        leave_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_group(size: int, fn: Callable[..., Any], *args: Any, cuda: bool = False) -> list[Any]:
    """Every rank's `fn(tp, *args)`, rank 0 first (with `cuda`: rank r on cuda:r, which
    `fn` finds as torch.cuda.current_device()); a rank that raised fails the call with
    its traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        procs = [
            ctx.Process(target=_rank, args=(r, size, rendezvous, fn, args, results, cuda))
            for r in range(size)
        ]
        for proc in procs:
            proc.start()
        got: dict[int, Any] = {}
        try:
            for _ in procs:
                rank, ok, value = results.get(timeout=GROUP_TIMEOUT_S * 2)
                if not ok:
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                got[rank] = value
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    return [got[r] for r in range(size)]
