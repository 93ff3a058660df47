"""Tensor parallelism: one engine's model split over the N processes of a group.

Every rank holds a shard of each layer (Megatron's split, as vLLM, SGLang and LMDeploy
make it): the q, k, v and gate/up projections by output rows (each rank its own heads,
its own part of the MLP's width), the o and down projections by input columns, whose
partial products are summed over the group (`all_reduce`); the embedding and the output
head by vocabulary rows (`vocab_part`), the embedding's rows summed, the head's logits
gathered (`gather_columns`). Each rank's KV pool holds its own KV heads only: the same
block ids, a block of H_kv / N heads.

Rank 0 (the engine worker) schedules and samples; the other ranks run the same
forwards (group_backend.py). The collectives go through torch.distributed: gloo on CPU
(so CI runs a group of two processes), NCCL on CUDA (captured by CUDA graphs). Pure but
for them: no process, no socket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from lmd.engine.config import MAX_TP


class ParallelError(ValueError):
    """A model that cannot be split this way; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in its group: rank `rank` of `size` (size 1: no group)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.size <= MAX_TP or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size} is not a tensor-parallel rank")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def part(self, n: int, what: str) -> slice:
        """This rank's share of `n` equal units (heads, MLP columns): n / size of them;
        ParallelError unless `size` divides `n`."""
        if n % self.size:
            raise ParallelError(
                f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}"
            )
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def vocab_part(self, vocab_size: int) -> slice:
        """This rank's rows of the embedding and the output head: ceil(V / size) each,
        the last rank's fewer (or none) when size does not divide V."""
        per = self.vocab_per_rank(vocab_size)
        return slice(min(self.rank * per, vocab_size), min((self.rank + 1) * per, vocab_size))

    def vocab_per_rank(self, vocab_size: int) -> int:
        return math.ceil(vocab_size / self.size)

    def all_reduce(self, x: Tensor) -> Tensor:
        """x summed over the group, in place (returned for chaining)."""
        if self.enabled:
            dist.all_reduce(x)
        return x

    def gather_columns(self, x: Tensor, width: int) -> Tensor:
        """Every rank's x: [R, per] side by side -> [R, width] (per = ceil(width / size);
        a shorter last part is padded for the exchange, then cut off)."""
        if not self.enabled:
            return x
        per = math.ceil(width / self.size)
        if x.shape[1] < per:
            x = torch.nn.functional.pad(x, (0, per - x.shape[1]))
        rows = x.shape[0]
        parts = torch.empty(self.size * rows, per, dtype=x.dtype, device=x.device)  # [N R, per]
        _all_gather(parts, x.contiguous())
        every = parts.view(self.size, rows, per).transpose(0, 1).reshape(rows, self.size * per)
        return every[:, :width]

    def broadcast(self, x: Tensor) -> Tensor:
        """Rank 0's x on every rank, in place."""
        if self.enabled:
            dist.broadcast(x, src=0)
        return x


SINGLE = TensorParallel()


def _all_gather(out: Tensor, x: Tensor) -> None:
    """out: [N * rows, ...] <- every rank's x [rows, ...], rank after rank (torch 2.13
    renamed all_gather_into_tensor)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x)


def join_group(
    rank: int, size: int, rendezvous: Path, device: torch.device, timeout_s: float
) -> TensorParallel:
    """Join the group that meets at the file `rendezvous` (which rank 0 removed before
    any rank started): gloo on CPU, NCCL on CUDA; then one all-reduce, so that every
    rank's communicator exists before anything (a CUDA graph) needs it. A rank that
    does not come within `timeout_s` fails every other's join, and so does any later
    collective that waits on a rank longer (a rank that died fails it at once)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if str(device) == "cuda":  # NCCL's device_id needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend,
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    tp = TensorParallel(rank, size)
    tp.all_reduce(torch.zeros(1, device=device))
    return tp


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
