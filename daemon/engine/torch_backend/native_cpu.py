"""Whether this process runs lmd._native's CPU kernels for the torch backend: the fp32
linears at decode (native/panel_gemm.h, used by linear.py) and decode attention over the
paged pool (native/paged_attention.h, used by attention.py). Both need AVX2 and FMA."""

from __future__ import annotations

import functools


@functools.cache
def supported() -> bool:
    try:
        from lmd._native import cpu_kernels_supported
    except ImportError:  # a source tree without the built extension
        return False
    return bool(cpu_kernels_supported())
