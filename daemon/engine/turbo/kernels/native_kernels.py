"""One of lmd._native's GPU kernel modules (their PTX, JIT-compiled by the driver on first
use into PyTorch's context) as its Python launchers see it: loaded on a CUDA device or
not, asked once a device (call `ready` before a CUDA graph is captured), why not logged
once (the launcher then runs its Triton kernels), and the device's multiprocessors,
which the launches size their grids by."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def device_index(device: torch.device) -> int:
    """A CUDA device's ordinal (the current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


class NativeKernels:
    """probe(ordinal) -> "" when the module loaded there, else why not (lmd._native's
    *_ready); `fallback` says in the log what runs instead."""

    def __init__(self, probe: Callable[[int], str], fallback: str) -> None:
        self._probe = probe
        self._fallback = fallback
        self._ready: dict[int, bool] = {}
        self._num_sms: dict[int, int] = {}

    def ready(self, index: int) -> bool:
        """Is the module loaded on device `index`? Loads it on the first call."""
        if index not in self._ready:
            why = self._probe(index)
            if why:
                log.warning("%s on cuda:%d: %s", self._fallback, index, why)
            else:
                self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
            self._ready[index] = not why
        return self._ready[index]

    def num_sms(self, index: int) -> int:
        """Device `index`'s multiprocessors (once `ready(index)`)."""
        return self._num_sms[index]
