"""The KV pool: one tensor per engine process, block-major, and how big to make it.

Layout (docs/architecture.md §5): kv: [num_blocks, num_layers, 2 (k, v), block_size,
num_kv_heads, head_dim]. One block of every layer is one contiguous byte range, so a
migration copies whole blocks, and consecutive block ids merge into one range.

A quantized pool (`kv_cache_dtype` int8 or fp8, kv_layout.py) keeps that: `kv` is a
strided view of each block's codes (block stride = the block's bytes) and `kv_scales` one
of their scales after them, over the same memory, so a block still migrates as one byte
range, at (D + 2) / 2D of a 16-bit block.

Size: `cache_max_entry_count` of the free memory (LMDeploy's rule). On a GPU that is the
device's free memory after the weights. On CPU there is none to ask for: an engine's
"free memory" is its even share of half the available RAM, and never more than what the
daemon's cap (CPU_KV_CAP_BYTES, for the pools of all its engines together) leaves after
the pools its other engines hold (`cpu_kv_free`); an engine added by `lmdctl scale`
thus takes a fraction of what the cap leaves, as a second engine on a GPU takes a
fraction of what the first left free.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from typing import TYPE_CHECKING

import psutil
import torch

from lmd.engine.kv_layout import bytes_per_block, quantized_views

if TYPE_CHECKING:
    from lmd.engine.backend import Backend
    from lmd.engine.config import EngineConfig

# On CPU there is no "free device memory": the engines of one daemon share a part of the
# available RAM (prefill and decode processes share one machine), at most this much.
CPU_KV_CAP_BYTES = 4 << 30

PoolBuffer = torch.Tensor | bytearray | memoryview | mmap.mmap


def block_bytes_of(backend: Backend, block_size: int) -> int:
    """Bytes of one block of the pool `backend` reads (its layers, heads, KV dtype)."""
    b = backend
    return bytes_per_block(
        b.num_layers,
        b.num_kv_heads,
        b.head_dim,
        block_size,
        b.dtype,
        kv_cache_dtype=b.kv_cache_dtype,
    )


def num_blocks_for(
    cache_max_entry_count: float | int, free_bytes: int, bytes_per_block: int
) -> int:
    """Blocks in the pool, with LMDeploy's cache_max_entry_count semantics.

    A float in (0, 1] takes that fraction of `free_bytes` (free device memory after the
    weights); an int > 0 is the block count itself, which must fit in `free_bytes`.
    """
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    if isinstance(cache_max_entry_count, bool):
        raise ValueError(f"cache_max_entry_count must be a number, got {cache_max_entry_count}")
    if isinstance(cache_max_entry_count, int):
        if cache_max_entry_count < 1:
            raise ValueError(
                f"cache_max_entry_count as a block count must be > 0, got {cache_max_entry_count}"
            )
        needed = cache_max_entry_count * bytes_per_block
        if needed > free_bytes:
            raise ValueError(
                f"cache_max_entry_count={cache_max_entry_count} blocks need "
                f"{needed / 2**30:.2f} GiB but only {free_bytes / 2**30:.2f} GiB is free; "
                "lower it or pass a fraction"
            )
        return cache_max_entry_count
    if not 0.0 < cache_max_entry_count <= 1.0:
        raise ValueError(
            f"cache_max_entry_count as a fraction must be in (0, 1], got {cache_max_entry_count}"
        )
    num_blocks = int(free_bytes * cache_max_entry_count) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"cache_max_entry_count={cache_max_entry_count} of {free_bytes / 2**20:.1f} MiB "
            f"free holds no {bytes_per_block / 2**20:.2f} MiB block; free memory or raise it"
        )
    return num_blocks


def cpu_free_bytes(
    available_bytes: int, *, share: float = 0.5, cap_bytes: int = CPU_KV_CAP_BYTES
) -> int:
    """What a CPU engine treats as free memory: a share of available RAM, capped."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share}")
    return max(0, min(int(available_bytes * share), cap_bytes))


def cpu_kv_free(
    available_bytes: int,
    num_engines: int,
    taken_bytes: int = 0,
    *,
    cap_bytes: int = CPU_KV_CAP_BYTES,
) -> int:
    """What one of `num_engines` CPU engines of a daemon treats as free memory: its even
    share of half the available RAM (capped), and no more than the cap leaves after the
    `taken_bytes` the daemon's other engines' pools hold. The pool then takes
    cache_max_entry_count of it, so all the pools together stay within `cap_bytes`."""
    share = cpu_free_bytes(available_bytes, cap_bytes=cap_bytes) // max(1, num_engines)
    return max(0, min(share, cap_bytes - taken_bytes))


def size_pool(
    backend: Backend, config: EngineConfig, cpu_engines: int = 1, cpu_free: int | None = None
) -> int:
    """Blocks for the pool: cache_max_entry_count of the free memory after the weights.

    On CPU, "free memory" is `cpu_free` (the engine worker's claim, cpu_kv_free over the
    pools its daemon holds), else an even share of the available RAM between `cpu_engines`.
    """
    per_block = block_bytes_of(backend, config.block_size)
    if backend.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(backend.device)
    elif cpu_free is not None:
        free = cpu_free
    else:
        free = cpu_kv_free(psutil.virtual_memory().available, cpu_engines)
    return num_blocks_for(config.cache_max_entry_count, free, per_block)


class KVPool:
    """The engine's KV cache: one allocation, block-major, indexed by block id.

    Pass `buffer` (a flat tensor, or a writable bytearray/memoryview/mmap such as a
    shared-memory mapping) to view existing memory instead of allocating; the pool then
    keeps its contents as they are. A pool it allocates itself starts zeroed, so that
    unused slots never hold NaNs an attention kernel could pick up. `kv_cache_dtype`
    int8 or fp8 makes a quantized pool (module docstring): `kv` holds the codes,
    `kv_scales` their scales; None for a pool in `dtype`.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        buffer: PoolBuffer | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.kv_cache_dtype = kv_cache_dtype
        self.block_nbytes = bytes_per_block(
            num_layers, num_kv_heads, head_dim, block_size, dtype, kv_cache_dtype=kv_cache_dtype
        )
        nbytes = self.nbytes_for(num_blocks)
        if buffer is None:
            raw = torch.zeros(nbytes, dtype=torch.uint8, device=device or "cpu")
        else:
            raw = _as_bytes(buffer, device)
            if raw.numel() < nbytes:
                raise ValueError(
                    f"buffer holds {raw.numel()} bytes but {num_blocks} blocks need {nbytes}"
                )
            if raw.data_ptr() % dtype.itemsize:
                raise ValueError(f"buffer is not aligned to {dtype.itemsize} bytes for {dtype}")
        self._raw = raw[:nbytes]  # [N * block_nbytes] uint8: what migrations copy
        self.kv_scales: torch.Tensor | None = None
        if kv_cache_dtype == "auto":
            # kv: [N, L, 2, S, Hkv, D]
            shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
            self.kv = self._raw.view(dtype).view(shape)
        else:
            layout = (num_layers, block_size, num_kv_heads, head_dim)
            self.kv, self.kv_scales = quantized_views(raw, num_blocks, layout, kv_cache_dtype)

    @classmethod
    def for_backend(
        cls, backend: Backend, num_blocks: int, block_size: int, buffer: PoolBuffer | None = None
    ) -> KVPool:
        """The pool `backend` reads and writes, of `num_blocks` blocks."""
        return cls(
            num_blocks,
            num_layers=backend.num_layers,
            num_kv_heads=backend.num_kv_heads,
            head_dim=backend.head_dim,
            block_size=block_size,
            dtype=backend.dtype,
            device=backend.device,
            buffer=buffer,
            kv_cache_dtype=backend.kv_cache_dtype,
        )

    def nbytes_for(self, num_blocks: int) -> int:
        return num_blocks * self.block_nbytes

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[0]

    @property
    def num_layers(self) -> int:
        return self.kv.shape[1]

    @property
    def block_size(self) -> int:
        return self.kv.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def data_ptr(self) -> int:
        """Address of block 0: what a transport registers with its peer."""
        return self._raw.data_ptr()

    def block_offset(self, block_id: int) -> int:
        """Byte offset of `block_id` from the start of the pool."""
        self._check_block(block_id)
        return block_id * self.block_nbytes

    def contiguous_ranges(self, block_ids: Iterable[int]) -> list[tuple[int, int]]:
        """(byte offset, byte length) per run of consecutive block ids, in order."""
        ranges: list[tuple[int, int]] = []
        previous = -2
        for block_id in block_ids:
            offset = self.block_offset(block_id)
            if ranges and block_id == previous + 1:
                start, length = ranges[-1]
                ranges[-1] = (start, length + self.block_nbytes)
            else:
                ranges.append((offset, self.block_nbytes))
            previous = block_id
        return ranges

    def block(self, block_id: int) -> torch.Tensor:
        """One block of every layer. # [L, 2, S, Hkv, D]"""
        self._check_block(block_id)
        return self.kv[block_id]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided k and v views of one layer. # each [N, S, Hkv, D]"""
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer {layer_idx} out of range 0..{self.num_layers - 1}")
        return self.kv[:, layer_idx, 0], self.kv[:, layer_idx, 1]

    def as_bytes(self) -> torch.Tensor:
        """The whole pool as a flat uint8 view (same memory). # [N * block_nbytes]"""
        return self._raw

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} out of range 0..{self.num_blocks - 1}")


def _as_bytes(buffer: PoolBuffer, device: torch.device | str | None) -> torch.Tensor:
    """A flat uint8 tensor over `buffer`'s memory (no copy)."""
    if isinstance(buffer, torch.Tensor):
        if device is not None and torch.device(device) != buffer.device:
            raise ValueError(f"buffer is on {buffer.device} but device={device} was asked")
        if not buffer.is_contiguous():
            raise ValueError("buffer tensor must be contiguous")
        return buffer.reshape(-1).view(torch.uint8)
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"a host buffer cannot back a pool on {device}")
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    view = view.cast("B")
    if view.readonly:
        raise ValueError("buffer is read-only; the KV pool must be writable")
    if view.nbytes == 0:
        raise ValueError("buffer is empty")
    return torch.frombuffer(view, dtype=torch.uint8)
