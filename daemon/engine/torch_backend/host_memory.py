"""Keep freed host memory in the process instead of handing it back to the kernel.

glibc serves every allocation above its mmap threshold (128 KiB at first, raised on the
fly up to 32 MiB) with a fresh mmap and gives heap memory above its trim threshold back
on free. A CPU forward allocates and frees megabytes per operation (a prefill of 8 x 128
tokens makes [1024, 1536] fp32 activations: 6 MiB each), so each one came back as fresh
pages, faulted in and zeroed one 4 KiB page at a time: a large part of a prefill on the
2-core dev machine (docs/benchmarks.md, 'CPU, second pass: oneDNN linears, block copies,
malloc, threads', and 'Figures that code comments used to quote'). With a fixed 32 MiB
mmap threshold and a 1 GiB trim threshold, freed activations are reused from the heap as
they are.

Process-wide: every CPU backend sets it (setting it again changes nothing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper limit for this parameter on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False where there is no glibc mallopt."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if ok:
        log.info(
            "malloc keeps freed memory: mmap threshold %d MiB, trim threshold %d MiB",
            MMAP_THRESHOLD_BYTES >> 20,
            TRIM_THRESHOLD_BYTES >> 20,
        )
    return ok
