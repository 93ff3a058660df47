"""GPU memory and utilisation through NVML (`pynvml`, from the optional `nvidia-ml-py`).

Never raises: without pynvml, without a driver or without a device, the answer says why
(`{"available": false, "reason": "..."}`). NVML sees every GPU of the host, whatever
CUDA_VISIBLE_DEVICES says. Blocking (NVML calls take milliseconds; the first init up to
about a second): run it in a thread from async code.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

INSTALL_HINT = "pip install 'lmd[gpu]'"


def unavailable(reason: str) -> dict[str, Any]:
    return {"available": False, "reason": reason, "devices": []}


def _load_nvml() -> ModuleType | None:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def _memory(nvml: Any, handle: Any) -> Any:
    """Memory info whose `used` is what nvidia-smi shows: version 2 leaves out what the
    driver reserves (about 500 MiB on an H100, counted as used by version 1)."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        except nvml.NVMLError:
            pass  # an older driver: version 1
    return nvml.nvmlDeviceGetMemoryInfo(handle)


def _device(nvml: Any, index: int) -> dict[str, Any]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = nvml.nvmlDeviceGetName(handle)
    memory = _memory(nvml, handle)
    try:
        utilization: int | None = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except nvml.NVMLError:
        utilization = None  # e.g. a MIG slice reports none
    return {
        "index": index,
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "memory_used_bytes": int(memory.used),
        "memory_total_bytes": int(memory.total),
        "utilization_percent": utilization,
    }


def read_gpus(nvml: Any = None) -> dict[str, Any]:
    """{"available", "reason", "devices": [{"index", "name", "memory_used_bytes",
    "memory_total_bytes", "utilization_percent"}]}; `nvml` defaults to pynvml."""
    nvml = nvml if nvml is not None else _load_nvml()
    if nvml is None:
        return unavailable(f"pynvml not installed ({INSTALL_HINT})")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return unavailable(f"no GPU (NVML: {exc})")
    try:
        count = int(nvml.nvmlDeviceGetCount())
        if count == 0:
            return unavailable("no GPU (NVML found no device)")
        return {
            "available": True,
            "reason": None,
            "devices": [_device(nvml, i) for i in range(count)],
        }
    except nvml.NVMLError as exc:
        return unavailable(f"NVML failed: {exc}")
    finally:
        nvml.nvmlShutdown()
