"""Small things the attention kernels share."""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634  # scores are scaled by log2(e) so that exp2 replaces exp


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: true float32 for a float32 model (Triton's default,
    tf32, keeps 10 mantissa bits); half-precision inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"
