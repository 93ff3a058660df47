"""Types of lmd._native (the C++ extension built from native/)."""

from typing import TypedDict

ABI_VERSION: int

class CudaProbe(TypedDict):
    available: bool
    devices: int
    reason: str

def probe_cuda() -> CudaProbe:
    """Load the CUDA driver at run time and count devices; never raises."""
