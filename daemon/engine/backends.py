"""Which backend runs a model: the backends by name, and the choice `auto` makes.

This is the one module that knows every backend; backend.py, their interface, knows
none. A backend module is imported only once chosen (turbo imports triton, torch
transformers' model classes).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from lmd.engine.backend import Backend, BackendError, parse_dtype
from lmd.engine.config import EngineConfig, architecture, checkpoint_quant_method
from lmd.engine.group_backend import GroupBackend, OpLink
from lmd.engine.parallel import SINGLE, TensorParallel

log = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "turbo", "fake")


def select_backend(
    name: str,
    architecture: str,
    device: torch.device | str,
    model_dir: Path | None = None,
    *,
    quantized: str | None = None,
) -> type[Backend]:
    """The backend class for `name` ("auto", "torch", "turbo" or "fake") on `device`.

    `fake` computes nothing (engine/fake_backend.py): for tests and `lmd-bench front`.
    `turbo` (engine/turbo/) serves the Llama family, Qwen3, Qwen3-MoE and Mixtral on
    CUDA; asked for where it cannot run, it is a BackendError with the reason. `auto`
    takes turbo where it can run and torch otherwise, with a log line that says which
    and why. With `model_dir`, its config.json
    is checked too (turbo refuses, e.g., rotary types that depend on the length).
    Quantized weights or KV (`quantized` names what was asked; a checkpoint's
    quantization_config counts too) run on turbo only: `auto` then refuses rather than
    fall back.
    """
    if name not in BACKEND_NAMES:
        raise BackendError(f"backend {name!r} is not one of {', '.join(BACKEND_NAMES)}")
    if name == "fake":
        from lmd.engine.fake_backend import FakeBackend

        return FakeBackend
    if name in ("turbo", "auto"):
        from lmd.engine.turbo import unsupported_reason

        reason = unsupported_reason(architecture, device, model_dir)
        if reason is None:
            from lmd.engine.turbo.backend import TurboBackend

            if name == "auto":
                log.info(
                    "backend auto: using turbo for %s (turbo implements it on CUDA)", architecture
                )
            return TurboBackend
        if name == "turbo":
            raise BackendError(f"backend turbo cannot run here: {reason}; use torch or auto")
        method = checkpoint_quant_method(model_dir) if model_dir is not None else None
        quantized = quantized or (method and f"a {method} checkpoint")
        if quantized is not None:
            raise BackendError(f"{quantized} runs on backend turbo only, which cannot: {reason}")
        log.warning("backend auto: using torch for %s because %s", architecture, reason)
    from lmd.engine.torch_backend import TorchBackend

    return TorchBackend


def load_backend(
    name: str,
    model_dir: Path,
    device: torch.device,
    dtype: str,
    config: EngineConfig,
    *,
    tp: TensorParallel = SINGLE,
    ranks: OpLink | None = None,
) -> Backend:
    """The backend `select_backend` picks, loaded from `model_dir` onto `device` in `dtype`
    ("auto": parse_dtype's) with `config`'s quantization: rank tp.rank's shard of a
    tensor-parallel group, and, for rank 0 (`ranks`: the other ranks' op channel), behind
    a GroupBackend that has them run every call too (group_backend.py)."""
    kind = select_backend(
        name, architecture(model_dir), device, model_dir, quantized=config.quantized
    )
    # The CPU's GEMM type is the torch backend's alone (torch_backend/linear.py).
    options: dict[str, Any] = {}
    if kind.name == "torch":
        options["cpu_matmul_dtype"] = config.cpu_matmul_dtype
    model = kind(
        model_dir,
        device,
        parse_dtype(dtype, device),
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
        tp=tp,
        **options,
    )
    return model if ranks is None else GroupBackend(model, ranks)
