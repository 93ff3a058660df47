"""A tensor-parallel group's batch-1 all-reduces, done by the products themselves over
peer memory instead of NCCL (issue 23: 64 all-reduces of 8 KiB were ~0.5 ms of a
3.7 ms TP 2 step on two H200s, each one NCCL kernel of ~7.8 us in the graph).

Every rank maps one buffer of every other rank (PyTorch's symmetric memory over CUDA
IPC; no NVLink multicast): `words` [P, N, K], a row per point and rank of tagged words
(kernels/tagged.py: a value and the step's count in one word of twice its width),
P = 2 points a layer (after o, after down). At point p the row-parallel product (o or
down, kernels/gemv.py with `send`) sums its own row over the group: each program
  1. stores its columns of this rank's partial row, tagged with this step, into slot
     [p, its rank] of every other rank's `words`;
  2. polls its own `words` until the other ranks' words for its columns carry this
     step's tag, and writes the sum (the N rows in rank order in float32, rounded to
     the weights' dtype: what NCCL's sum gives) into this rank's `rows[p]`,
so the next product (qkv, gate|up or lm_head) reads a plain summed row. Every rank's
programs of one send wait for each other's: a send takes at most one program a
multiprocessor, so all of them run at once on every GPU.
No flag and no fence: a word is one aligned store, so its tag vouches for its value (as
NCCL's LL protocol does). `step` counts the steps that used the exchange (every rank
runs the same steps; a device counter the graphs replay); a word written in step s
holds tag s mod 2^(the value's bits) and every step rewrites every word, so a stale
word is always one step behind and never passes (a send takes the values only after
its wait, kernels/tagged.py). A slot is written again one step later only after every
rank has read it: a rank reaches point p of step s + 1 only with the other ranks' rows
of point p - 1 of step s + 1, which each of them wrote after its point-p send of step
s, reads included, had finished. A rank that dies mid-step leaves the others polling in
the kernel, as NCCL would wait, until the supervisor restarts the group.

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


WORDS = {2: torch.int32, 4: torch.int64}  # a value's bytes -> its tagged word's dtype


class PeerExchange:
    """This rank's view of the group's exchange buffers (module docstring)."""

    def __init__(self, rank: int, rows: Tensor, words: Tensor, word_ptrs: Tensor) -> None:
        points, size, width = words.shape
        if rows.shape != (points, width) or words.dtype != WORDS.get(rows.element_size()):
            raise ValueError("words are [points, ranks, K] of twice the rows' width")
        if word_ptrs.shape != (size,) or not 0 <= rank < size:
            raise ValueError("one words address per rank")
        self.rank = rank
        self.rows = rows  # [P, K]: the group's sums, as this rank's sends write them
        self.words = words  # [P, N, K]: the other ranks' rows, tagged, as they land here
        self.word_ptrs = word_ptrs  # [N] int64: every rank's `words`, mapped here
        self.step = torch.zeros(1, dtype=torch.int64, device=rows.device)
        # The least columns a send's program takes: its programs wait for the peers',
        # so a send takes at most one program a multiprocessor (all of them run at once).
        programs = (
            torch.cuda.get_device_properties(rows.device).multi_processor_count
            if rows.is_cuda
            else width
        )
        self.send_block_n = 1 << (-(-width // programs) - 1).bit_length()

    @property
    def size(self) -> int:
        return self.words.shape[1]

    @property
    def width(self) -> int:
        return self.words.shape[2]

    @property
    def num_points(self) -> int:
        return self.words.shape[0]

    def begin_step(self) -> None:
        """Before a step's first point (on the device: a graph replays it)."""
        self.step += 1

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

            word = WORDS[torch.empty(0, dtype=dtype).element_size()]
            words = symm_mem.empty((num_points, size, width), dtype=word, device=device)
            words.zero_()  # tag 0: no step's (steps count from 1)
            handle = symm_mem.rendezvous(words, group.group_name)
            if handle.buffer_ptrs[rank] != words.data_ptr():
                raise RuntimeError("a symmetric buffer that does not start its allocation")
            ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
            rows = torch.zeros(num_points, width, dtype=dtype, device=device)
            exchange = cls(rank, rows, words, ptrs)
        except Exception as exc:  # any failure: NCCL stays, with the reason
            log.warning("rank %d: no peer exchange for batch-1 all-reduces (%s)", rank, exc)
        ready = torch.tensor([exchange is not None], dtype=torch.int32, device=device)
        dist.all_reduce(ready, op=dist.ReduceOp.MIN)  # also: every word zeroed before use
        if not ready.item():
            return None
        return exchange


@dataclass(frozen=True, slots=True)
class Point:
    """One all-reduce point of a step's exchange: the product that makes this rank's
    partial row sums it over the group there (gemv's `send`)."""

    exchange: PeerExchange
    index: int  # < exchange.num_points

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.exchange.num_points:
            raise ValueError(f"point {self.index} of an exchange of {self.exchange.num_points}")

    @property
    def local_row(self) -> Tensor:
        """[1, K]: the group's sum at this point, as this rank's send writes it."""
        return self.exchange.rows[self.index].unsqueeze(0)
