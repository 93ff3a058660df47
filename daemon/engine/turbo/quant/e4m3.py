"""The FP8 (e4m3) format's numbers the weights (quant/fp8.py) and the kernels
(kernels/fp8.py) share."""

from __future__ import annotations

FP8_MAX = 448.0  # e4m3fn's largest finite value
BLOCK = 128  # the only weight block the kernels take: (128, 128)
AMAX_FLOOR = 1e-10  # an all-zero row still gets a positive scale (its codes are 0)
