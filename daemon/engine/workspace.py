"""Workspace: scratch [R, V] tensors that the sampler reuses from step to step.

On CPU a fresh tensor of a few MiB comes from mmap and is paid for in page faults on first
touch, one 4 KiB page at a time: on the 2-core dev machine that costs more than the
arithmetic done on one [64, 49152] float32 tensor, and the faults of the four such tensors
a sampled decode step made were nearly all of its time (docs/benchmarks.md, 'Page faults,
the fake backend's buffer, the sampled path'). A Workspace keeps one buffer per name and
hands out views of its first rows. A view is valid until the next `get` of the same name;
the caller makes sure no two live tensors share a name. On other devices (CUDA's caching
allocator reuses memory already) `get` returns a fresh tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Workspace:
    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(
        self,
        name: str,
        rows: int,
        cols: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """An uninitialized [rows, cols] tensor, the first rows of buffer `name` on CPU."""
        if device.type != "cpu":
            return torch.empty(rows, cols, dtype=dtype, device=device)
        buf = self._buffers.get(name)
        if buf is None or buf.shape[1] != cols or buf.dtype != dtype:
            buf = torch.empty(rows, cols, dtype=dtype)
        elif buf.shape[0] < rows:
            buf = torch.empty(max(rows, 2 * buf.shape[0]), cols, dtype=dtype)
        self._buffers[name] = buf
        return buf[:rows]

    @property
    def nbytes(self) -> int:
        """Memory held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
