"""What `/v1/models` says of the served model: OpenAI's model card, plus how it runs
quantized (a user comparing answers across deployments needs to know)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmd.config import ServeConfig
from lmd.engine.config import checkpoint_quant_method


def model_card(config: ServeConfig, created: int) -> dict[str, Any]:
    """`quantization`: the weights' (--quantization, else the checkpoint's own method,
    e.g. "awq"; None for 16-bit weights); `kv_cache_dtype`: auto, int8 or fp8."""
    weights = config.quantization
    if weights is None and config.model is not None and Path(config.model).is_dir():
        weights = checkpoint_quant_method(Path(config.model))
    return {
        "id": config.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "lmd",
        "quantization": weights,
        "kv_cache_dtype": config.kv_cache_dtype,
    }
