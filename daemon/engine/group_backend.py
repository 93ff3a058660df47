"""A tensor-parallel group behind one Backend: rank 0's side and every other rank's.

Rank 0 (the engine worker) runs the engine around `GroupBackend`, its own shard's
backend wrapped; ranks 1..N-1 (lmd.rank) each run a `RankRunner` around theirs. Life
cycle of a call the engine makes on its backend:
  1. Every call that computes (forward, forward_eager, capture_graphs, probe_graphs)
     goes to the other ranks first, as one op (`encode_op`: a JSON header, the batch's
     arrays as raw frames; token ids already on the device go by a broadcast), then
     runs here. The ranks run the same call, in the same order, on their own shard and
     pool, so the collectives inside (parallel.py) meet; rank 0 alone gets the logits
     it samples from (every rank gathers them; the others drop theirs).
  2. A pool is shown to the ranks before its first op: the engine's own through
     `adopt_pool` (a rank takes its memory from its migration transport, as rank 0
     does), any other (a scratch pool of the memory profile) the first time a call
     uses it; the ranks allocate theirs with the same block count, and drop it when
     rank 0's is gone.
Nothing here waits for an answer: a rank that fails dies, its collectives fail on
every other rank, and the worker watching it (hybrid/rank_group.py) restarts the group.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import orjson
import torch
from torch import Tensor

from lmd.engine.backend import Backend
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.kv_pool import KVPool, PoolBuffer, block_bytes_of
from lmd.engine.parallel import TensorParallel

# ForwardBatch's fields that travel as frames, in order (input_ids only from the host).
BATCH_FIELDS = (
    "input_ids",
    "positions",
    "seq_lens",
    "context_lens",
    "block_tables",
    "slot_mapping",
    "logits_indices",
)


class OpLink(Protocol):
    """Rank 0's channel to the other ranks of its group: one op to all of them; raises
    RuntimeError once the group is broken."""

    def send(self, header: dict[str, Any], frames: Sequence[bytes] = ()) -> None: ...


def encode_batch(batch: ForwardBatch) -> tuple[dict[str, Any], list[bytes]]:
    """The batch's arrays as (their dtypes and shapes, their bytes); token ids that are
    on the device are left out (`ids_on_device`: their count)."""
    arrays, frames = [], []
    on_device = batch.input_ids.device.type != "cpu"
    for name in BATCH_FIELDS:
        if name == "input_ids" and on_device:
            continue
        array = getattr(batch, name).cpu().numpy()
        arrays.append([name, array.dtype.str, list(array.shape)])
        frames.append(array.tobytes())
    header = {"arrays": arrays, "ids_on_device": batch.num_tokens if on_device else 0}
    return header, frames


def decode_batch(
    header: dict[str, Any], frames: Sequence[bytes], device: torch.device | None = None
) -> ForwardBatch:
    """encode_batch's batch again, on a rank. Ids that were on rank 0's device get room on
    `device` (default: the host), for the caller to fill from the broadcast: made there,
    not copied there, as a copy from the host would wait for every step this rank has
    queued and so end its overlap of host and device work."""
    fields: dict[str, Tensor] = {}
    for (name, dtype, shape), raw in zip(header["arrays"], frames, strict=True):
        array = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
        fields[name] = torch.from_numpy(array.copy())
    if "input_ids" not in fields:
        fields["input_ids"] = torch.empty(header["ids_on_device"], dtype=torch.int64, device=device)
    return ForwardBatch(**fields)


class GroupBackend(Backend):
    """Rank 0's backend: its own shard (`local`), every computing call mirrored to the
    other ranks through `link` first (module doc)."""

    name: ClassVar[str] = "group"

    def __init__(self, local: Backend, link: OpLink) -> None:
        self.local = local
        self.link = link
        self._pools: dict[int, int] = {}  # data_ptr of a pool shown to the ranks -> its id
        self._next_pool = 0

    # Facts: the local shard's ---------------------------------------------------------

    @property
    def architecture(self) -> str:
        return self.local.architecture

    @property
    def num_layers(self) -> int:
        return self.local.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.local.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.local.head_dim

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.local.eos_token_ids

    @property
    def max_position_embeddings(self) -> int:
        return self.local.max_position_embeddings

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def kv_cache_dtype(self) -> str:
        return self.local.kv_cache_dtype

    @property
    def quantization(self) -> str | None:
        return self.local.quantization

    @property
    def kv_window(self) -> int:
        return self.local.kv_window

    @property
    def tp(self) -> TensorParallel:
        return self.local.tp

    @property
    def backend_name(self) -> str:
        return self.local.name

    def check_pool(self, kv: Tensor) -> None:
        self.local.check_pool(kv)

    # Calls that compute: the ranks first ----------------------------------------------

    def forward(self, batch: ForwardBatch, kv: Tensor) -> Tensor:
        self._mirror("forward", kv, batch)
        return self.local.forward(batch, kv)

    def forward_eager(self, batch: ForwardBatch, kv: Tensor) -> Tensor:
        self._mirror("forward_eager", kv, batch)
        return self.local.forward_eager(batch, kv)

    def forward_hidden(self, batch: ForwardBatch, kv: Tensor) -> tuple[Tensor, Tensor]:
        self._mirror("forward_eager", kv, batch)
        return self.local.forward_hidden(batch, kv)

    def capture_graphs(self, kv: Tensor, max_batch_size: int) -> None:
        self.link.send({"op": "capture", "pool": self._pool_id(kv), "max_batch": max_batch_size})
        self.local.capture_graphs(kv, max_batch_size)

    def probe_graphs(self, kv: Tensor, max_batch_size: int) -> object | None:
        self.link.send({"op": "probe", "pool": self._pool_id(kv), "max_batch": max_batch_size})
        probe = self.local.probe_graphs(kv, max_batch_size)
        if probe is not None:  # the ranks drop theirs when the caller drops this one
            weakref.finalize(probe, self._tell, {"op": "drop_probe"})
        return probe

    def adopt_pool(self, kv: Tensor) -> None:
        """`kv` is the engine's own pool: each rank makes its own of the same size from
        its migration transport's memory (the memory a peer's copies reach)."""
        self._show_pool(kv, engine=True)

    def _mirror(self, op: str, kv: Tensor, batch: ForwardBatch) -> None:
        header, frames = encode_batch(batch)
        self.link.send({"op": op, "pool": self._pool_id(kv), **header}, frames)
        if header["ids_on_device"]:
            self.tp.broadcast(batch.input_ids)

    def _pool_id(self, kv: Tensor) -> int:
        found = self._pools.get(kv.data_ptr())
        return self._show_pool(kv, engine=False) if found is None else found

    def _show_pool(self, kv: Tensor, *, engine: bool) -> int:
        pool_id, self._next_pool = self._next_pool, self._next_pool + 1
        key = kv.data_ptr()
        self._pools[key] = pool_id
        self.link.send(
            {
                "op": "pool",
                "pool": pool_id,
                "num_blocks": int(kv.shape[0]),
                "block_size": int(kv.shape[3]),
                "engine": engine,
            }
        )
        weakref.finalize(kv, self._forget_pool, key, pool_id)
        return pool_id

    def _forget_pool(self, key: int, pool_id: int) -> None:
        if self._pools.get(key) == pool_id:
            del self._pools[key]
        self._tell({"op": "drop", "pool": pool_id})

    def _tell(self, header: dict[str, Any]) -> None:
        """An op sent from a finalizer: a group already broken (the worker is exiting)
        needs it no more."""
        with contextlib.suppress(RuntimeError):
            self.link.send(header)


class RankRunner:
    """A rank's side: runs each op rank 0 sent on this rank's shard (`backend`).

    `pool_buffer(nbytes)` gives the engine pool's memory (its migration transport's
    region, or None to allocate); `on_engine_pool(pool)` is told when that pool exists."""

    def __init__(
        self,
        backend: Backend,
        pool_buffer: Callable[[int], PoolBuffer | None] | None = None,
        on_engine_pool: Callable[[KVPool], None] | None = None,
    ) -> None:
        self.backend = backend
        self.pool_buffer = pool_buffer
        self.on_engine_pool = on_engine_pool
        self.pools: dict[int, KVPool] = {}
        self.engine_pool: KVPool | None = None
        self._probe: object | None = None
        self.num_ops = 0

    def run(self, header: dict[str, Any], frames: Sequence[bytes]) -> None:
        """Run one op; ValueError for one this runner does not know."""
        self.num_ops += 1
        op = header["op"]
        pool = self.pools.get(header.get("pool", -1))
        if op in ("forward", "forward_eager"):
            batch = decode_batch(header, frames, self.backend.device)
            if header["ids_on_device"]:  # rank 0's sampled tokens, from its device
                batch.input_ids = self.backend.tp.broadcast(batch.input_ids)
            kv = _pool(pool, op).kv
            with torch.inference_mode():
                if op == "forward":
                    self.backend.forward(batch, kv)
                else:
                    self.backend.forward_eager(batch, kv)
        elif op == "pool":
            self._new_pool(
                header["pool"], header["num_blocks"], header["block_size"], header["engine"]
            )
        elif op == "drop":
            self.pools.pop(header["pool"], None)
        elif op == "capture":
            self.backend.capture_graphs(_pool(pool, op).kv, header["max_batch"])
        elif op == "probe":
            self._probe = self.backend.probe_graphs(
                self.pools[header["pool"]].kv, header["max_batch"]
            )
        elif op == "drop_probe":
            self._probe = None
        else:
            raise ValueError(f"unknown op {op!r}")

    def _new_pool(self, pool_id: int, num_blocks: int, block_size: int, engine: bool) -> None:
        buffer = None
        if engine and self.pool_buffer is not None:
            buffer = self.pool_buffer(num_blocks * block_bytes_of(self.backend, block_size))
        pool = KVPool.for_backend(self.backend, num_blocks, block_size, buffer)
        self.pools[pool_id] = pool
        if engine:
            self.engine_pool = pool
            if self.on_engine_pool is not None:
                self.on_engine_pool(pool)


def _pool(pool: KVPool | None, op: str) -> KVPool:
    if pool is None:
        raise ValueError(f"op {op} names a pool this rank does not hold")
    return pool


def encode_op(header: dict[str, Any], frames: Sequence[bytes] = ()) -> list[bytes]:
    """An op as ZeroMQ frames: the JSON header, then the raw frames."""
    return [orjson.dumps(header), *frames]


def decode_op(frames: Sequence[bytes]) -> tuple[dict[str, Any], Sequence[bytes]]:
    header = orjson.loads(frames[0])
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ValueError("an op's header must be a JSON object with its op")
    return header, frames[1:]
