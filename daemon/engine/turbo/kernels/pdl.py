"""Programmatic dependent launch (Hopper and later) for the decode step's kernels.

A batch-1 decode step is ~260 short kernels; between two of them the GPU drains the
first and ramps the second up, a few microseconds each that a TP 2 step (each product
half as long) feels twice as much. A kernel launched with PDL is let onto the SMs while
the kernel before it still runs: every program first lets the next kernel launch too
(`griddepcontrol.launch_dependents`), and then waits for the kernel before it to
finish and its writes to show (`griddepcontrol.wait`); everything the program reads or
writes comes after that wait, but a product's weights (kernels/gemv.py and
kernels/vector_gemv.py: `begin` prefetches the first slices of its weight rows into L2
before waiting, as they never depend on an earlier kernel). The other kernels of a
decode step (rotary and K/V write, decode attention and its merge, the activation,
the experts' top-k, layout and grouped GEMMs, whose weights are known only after the
wait) only `wait`. A kernel launched without PDL after one of these waits for it whole, as
always, so every chain of waits reaches back to the last plain launch. CUDA graphs keep
the launches' programmatic edges.

Off (ENABLED False) until a GPU run shows it faster (scripts/tp_step.py --pdl,
scripts/families_bench.py --pdl)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = False


def launch_options(device: torch.device) -> dict[str, Any]:
    """The launch's keyword arguments: PDL where enabled and the device has it."""
    if not ENABLED or device.type != "cuda":
        return {}
    return {"launch_pdl": True} if _has_pdl(device.index) else {}


@functools.cache
def _has_pdl(index: int | None) -> bool:
    """Hopper or later (asked once a device: launches ask at every eager step)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def begin(w_ptr, rows, n, k, stride_w, PREFETCH_K: tl.constexpr):  # noqa: PLR0917
    """A PDL-launched product's first step (module docstring): rows are its weight rows,
    the first PREFETCH_K of each go to L2 (one prefetch a 128-byte line)."""
    gdc_launch_dependents()
    line: tl.constexpr = 128 // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    ks = tl.minimum(tl.arange(0, PREFETCH_K // line) * line, k - 1)
    rows = tl.minimum(rows, n - 1).to(tl.int64)
    ptrs = w_ptr + rows[:, None] * stride_w + ks[None, :]
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    gdc_wait()


@triton.jit
def wait():
    """The first step of a PDL-launched kernel that streams no weights (attention,
    rotary, the activation): let the next kernel launch, then wait for the one before."""
    gdc_launch_dependents()
    gdc_wait()
