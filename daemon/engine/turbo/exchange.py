"""A tensor-parallel group's batch-1 all-reduces, done by the products themselves over
peer memory instead of NCCL (issue 23: 64 all-reduces of 8 KiB were ~0.5 ms of a
3.7 ms TP 2 step on two H200s, each one NCCL kernel of ~7.8 us in the graph).

Every rank maps one buffer of every other rank (PyTorch's symmetric memory over CUDA
IPC; no NVLink multicast): `data` [P, N, K] (a row per point and rank) and `flags`
[P, N] int64, P = 2 points a layer (after o, after down). At point p:
  1. the row-parallel product (o or down, kernels/gemv.py with `send`) writes its
     partial row into slot [p, its rank] of every rank's `data`; each program, after
     its columns, adds their count to `flags[p, its rank]` on every rank (a release);
  2. the next product (qkv, gate|up or lm_head, kernels/vector_gemv.py with
     `received`) waits until every rank's flag at p reaches `epoch * K` (an acquire on
     its own memory), then sums the N rows in rank order in float32, rounds to the
     weights' dtype (what NCCL's sum gives) and goes on as with a summed input.
`epoch` counts the steps that used the exchange (every rank runs the same steps), so
the flags only grow and nothing is reset. A slot is written again one step later only
after every rank has read it: a rank reaches point p of step s + 1 only with the other
ranks' rows of point p - 1 of step s + 1, which each of them made after reading its
point-p row of step s. A rank that dies mid-step leaves the others waiting in the kernel,
as NCCL would, until the supervisor restarts the group.

Only one-row steps (decode at batch 1) of dense models in half precision take it;
everything else keeps NCCL (engine/parallel.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger(__name__)


class PeerExchange:
    """This rank's view of the group's exchange buffers (module docstring)."""

    def __init__(
        self, rank: int, data: Tensor, flags: Tensor, data_ptrs: Tensor, flag_ptrs: Tensor
    ) -> None:
        points, size = data.shape[:2]
        if flags.shape != (points, size) or flags.dtype != torch.int64:
            raise ValueError("flags are [points, ranks] int64 beside data [points, ranks, K]")
        if data_ptrs.shape != (size,) or flag_ptrs.shape != (size,):
            raise ValueError("one data and one flags address per rank")
        self.rank = rank
        self.data = data  # [P, N, K], this rank's copy
        self.flags = flags  # [P, N] int64, this rank's copy
        self.data_ptrs = data_ptrs  # [N] int64: every rank's `data`, mapped here
        self.flag_ptrs = flag_ptrs  # [N] int64: every rank's `flags`
        self.epoch = torch.zeros(1, dtype=torch.int64, device=data.device)

    @property
    def size(self) -> int:
        return self.data.shape[1]

    @property
    def width(self) -> int:
        return self.data.shape[2]

    @property
    def num_points(self) -> int:
        return self.data.shape[0]

    def begin_step(self) -> None:
        """Before a step's first point (on the device: a graph replays it)."""
        self.epoch += 1

    @classmethod
    def create(
        cls, num_points: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> PeerExchange | None:
        """Map the buffers over the default process group (collective: every rank calls
        it). None, logged, where a rank cannot (no symmetric memory, no peer access): the
        group then keeps NCCL for everything."""
        group = dist.group.WORLD
        if group is None or device.type != "cuda":
            return None
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        rank, size = dist.get_rank(), dist.get_world_size()
        exchange = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            data = symm_mem.empty((num_points, size, width), dtype=dtype, device=device)
            flags = symm_mem.empty((num_points, size), dtype=torch.int64, device=device)
            flags.zero_()
            ptrs = []
            for t in (data, flags):
                handle = symm_mem.rendezvous(t, group.group_name)
                if handle.buffer_ptrs[rank] != t.data_ptr():
                    raise RuntimeError("a symmetric buffer that does not start its allocation")
                ptrs.append(torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device))
            exchange = cls(rank, data, flags, ptrs[0], ptrs[1])
        except Exception as exc:  # any failure: NCCL stays, with the reason
            log.warning("rank %d: no peer exchange for batch-1 all-reduces (%s)", rank, exc)
        ready = torch.tensor([exchange is not None], dtype=torch.int32, device=device)
        dist.all_reduce(ready, op=dist.ReduceOp.MIN)  # also: every flag zeroed before use
        if not ready.item():
            return None
        return exchange


@dataclass(frozen=True, slots=True)
class Point:
    """One all-reduce point of a step's exchange: the product that makes this rank's
    partial row sends it (gemv's `send`), the one that takes the sum receives it
    (vector_gemv's `received`)."""

    exchange: PeerExchange
    index: int  # < exchange.num_points

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.exchange.num_points:
            raise ValueError(f"point {self.index} of an exchange of {self.exchange.num_points}")

    @property
    def local_row(self) -> Tensor:
        """[1, K]: where this rank's partial row lands on this rank."""
        return self.exchange.data[self.index, self.exchange.rank].unsqueeze(0)
