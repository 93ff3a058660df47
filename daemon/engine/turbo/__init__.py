"""The turbo backend: our own Llama-family decoder with Triton kernels and CUDA graphs.

CUDA only (docs/architecture.md §5). Modules: `config` (what config.json must say), `weights`
(checkpoint -> fused tensors), `checkpoint` (the safetensors by name, or a tensor-parallel
rank's part of each), `rope` (rotary table), `model` (the decoder as plain
functions), `kernels/` (Triton), `graphs` (decode CUDA graphs), `backend`
(`TurboBackend`, the `Backend` the engine drives), `support` (can it run here?),
`quant/` (quantized linear weights: W4A16, FP8).
`support` and `config` import neither triton nor a GPU, so selection works anywhere.
"""

from __future__ import annotations

from lmd.engine.turbo.config import SUPPORTED_ARCHITECTURES, TurboConfig, UnsupportedModel
from lmd.engine.turbo.support import unsupported_reason

__all__ = ["SUPPORTED_ARCHITECTURES", "TurboConfig", "UnsupportedModel", "unsupported_reason"]
