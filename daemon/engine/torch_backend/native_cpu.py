"""Whether this process runs lmd._native's CPU kernels for the torch backend: the fp32
linears at decode (native/panel_gemm.h, used by linear.py) and decode attention over the
paged pool (native/paged_attention.h, used by attention.py). Both need AVX2 and FMA.
And whether the CPU has bf16 dot products, for oneDNN's bf16 GEMMs (linear.py)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def supported() -> bool:
    try:
        from lmd._native import cpu_kernels_supported
    except ImportError:  # a source tree without the built extension
        return False
    return bool(cpu_kernels_supported())


@functools.cache
def pair_gemm_supported() -> bool:
    """Does this process run lmd._native.pair_gemm (AVX-512 with BF16)?"""
    try:
        from lmd._native import pair_gemm_supported
    except ImportError:
        return False
    return bool(pair_gemm_supported())


BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names


@functools.cache
def has_bf16_dot(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Does this CPU multiply bf16 natively (AVX512-BF16 or AMX)? oneDNN's bf16 GEMMs
    run at twice fp32's rate there, and are emulated, slower than fp32, elsewhere."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return any(flag in flags for flag in BF16_DOT_FLAGS)
    return False
