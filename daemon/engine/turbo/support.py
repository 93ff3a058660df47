"""Can the turbo backend run here? Checked without loading a model (docs/architecture.md §5)."""

from __future__ import annotations

from pathlib import Path

import torch

from lmd.engine.turbo.config import SUPPORTED_ARCHITECTURES, TurboConfig, UnsupportedModel

# Triton's kernels here use bf16 tensor-core dots: Ampere (8.0) or newer.
MIN_COMPUTE_CAPABILITY = (8, 0)


def triton_import_error() -> str | None:
    """Why triton cannot be imported, or None when it can."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install raises more than ImportError
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"triton does not import ({first})"
    return None


def unsupported_reason(
    architecture: str, device: torch.device | str, model_dir: Path | None = None
) -> str | None:
    """One line saying why turbo cannot serve `architecture` on `device`, or None.

    With `model_dir`, its config.json is checked too (rope type, activation, ...).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"turbo needs CUDA and the device is {dev.type}"
    if architecture not in SUPPORTED_ARCHITECTURES:
        return (
            f"turbo does not implement {architecture} "
            f"(it serves {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if not torch.cuda.is_available():
        return "turbo needs CUDA and torch sees no CUDA device"
    capability = torch.cuda.get_device_capability(dev)
    if capability < MIN_COMPUTE_CAPABILITY:
        major, minor = MIN_COMPUTE_CAPABILITY
        return (
            f"turbo needs compute capability {major}.{minor}+ and "
            f"{torch.cuda.get_device_name(dev)} has {capability[0]}.{capability[1]}"
        )
    error = triton_import_error()
    if error is not None:
        return error
    if model_dir is not None:
        try:
            TurboConfig.load(model_dir)
        except UnsupportedModel as exc:
            return f"turbo cannot serve {model_dir}: {exc}"
    return None
