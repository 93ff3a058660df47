"""The batch a backend runs in one engine step (backend.py): every sequence's new tokens
packed into rows, their positions, block tables and the rows to sample."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor


@dataclass(slots=True)
class ForwardBatch:
    """One engine step: the new tokens of B sequences packed into T rows, no padding.

    Sequences may mix prefill chunks (many new tokens, maybe after a cached prefix) and
    decode steps (one new token). Sequence b owns rows `cu_seqlens[b]:cu_seqlens[b+1]`;
    its new tokens sit at positions `num_cached[b] .. context_lens[b]-1`, and the K/V of
    all `context_lens[b]` tokens lives in the blocks `block_tables[b]` lists in order
    (token p in block `block_tables[b, p // block_size]` at offset `p % block_size`).
    Build it with `ForwardBatch.pack`; `seq_lens` and `context_lens` stay on the CPU
    (the backend reads them without a device sync), the rest is copied to the device.
    `input_ids` may already be on the device: a decode step the engine runs ahead feeds
    the previous step's sampled tokens from where they are.
    """

    input_ids: Tensor  # [T] int64, new tokens, sequence after sequence (CPU or device)
    positions: Tensor  # [T] int64, position of each token in its sequence
    seq_lens: Tensor  # [B] int32 on CPU, new tokens per sequence (>= 1)
    context_lens: Tensor  # [B] int32 on CPU, cached + new tokens after this step
    block_tables: Tensor  # [B, max_blocks] int32, block ids, -1 padded
    slot_mapping: Tensor  # [T] int64, block_id * block_size + offset of each new token
    logits_indices: Tensor  # [R] int64, rows of T whose logits forward returns

    def __post_init__(self) -> None:
        t, b = self.input_ids.shape[0], self.seq_lens.shape[0]
        if self.input_ids.ndim != 1 or self.positions.shape != (t,):
            raise ValueError("input_ids and positions must both be [T]")
        if self.slot_mapping.shape != (t,):
            raise ValueError("slot_mapping must be [T], one slot per new token")
        if self.context_lens.shape != (b,) or self.block_tables.ndim != 2:
            raise ValueError("context_lens must be [B] and block_tables [B, max_blocks]")
        if self.block_tables.shape[0] != b or self.block_tables.dtype != torch.int32:
            raise ValueError("block_tables must be int32 with one row per sequence")
        if self.seq_lens.device.type != "cpu" or self.context_lens.device.type != "cpu":
            raise ValueError("seq_lens and context_lens must stay on the CPU")
        # numpy views of the CPU tensors: a torch op on the host costs far more than a numpy
        # one (docs/benchmarks.md, 'Run 2: measured').
        seq_lens, context_lens = self.seq_lens.numpy(), self.context_lens.numpy()
        if int(seq_lens.sum()) != t or (b and int(seq_lens.min()) < 1):
            raise ValueError("seq_lens must be >= 1 and sum to the number of tokens")
        if bool((context_lens < seq_lens).any()):
            raise ValueError("context_lens must count the new tokens too (>= seq_lens)")
        if self.positions.device.type == "cpu" and not np.array_equal(
            self.positions.numpy(), _positions(seq_lens, context_lens - seq_lens)
        ):
            raise ValueError("positions must run from num_cached to context_lens - 1")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def cu_seqlens(self) -> Tensor:
        """[B + 1] int32 on CPU: sequence b's rows are cu_seqlens[b]:cu_seqlens[b+1]."""
        out = torch.zeros(self.num_seqs + 1, dtype=torch.int32)
        torch.cumsum(self.seq_lens, 0, out=out[1:])
        return out

    @property
    def num_cached(self) -> Tensor:
        """[B] int32 on CPU: tokens already in the KV pool before this step."""
        return self.context_lens - self.seq_lens

    @classmethod
    def pack(
        cls,
        new_token_ids: Sequence[Sequence[int]],
        num_cached: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        sample: Sequence[bool] | None = None,
    ) -> ForwardBatch:
        """Pack B sequences' new tokens into one batch (CPU tensors).

        new_token_ids[b]: the tokens to run now (a prompt chunk, or the one last token);
        num_cached[b]: tokens of sequence b whose K/V is already in its blocks (a cached
        prefix or earlier chunks); block_tables[b]: its block ids, covering at least
        num_cached[b] + len(new_token_ids[b]) tokens; sample[b]: whether forward returns
        logits for its last token (False for a prompt chunk that is not the last; default
        all True).
        """
        b = len(new_token_ids)
        if not len(num_cached) == len(block_tables) == b or (
            sample is not None and len(sample) != b
        ):
            raise ValueError("pack needs one entry per sequence in every argument")
        # numpy, then zero-copy tensors: a torch op on the host costs far more than a numpy
        # one, and this runs every step (with torch ops it took a large share of a batch-1
        # step: docs/benchmarks.md, 'Where an engine decode step goes').
        seq_lens = np.fromiter(map(len, new_token_ids), dtype=np.int64, count=b)
        cached = np.asarray(num_cached, dtype=np.int64).reshape(b)
        context_lens = cached + seq_lens
        num_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=b)
        width = max(1, int(num_blocks.max(initial=1)))
        flat = np.fromiter(chain.from_iterable(block_tables), dtype=np.int64)
        if flat.size and int(flat.min()) < 0:
            raise ValueError("block ids must be >= 0")
        short = np.flatnonzero(num_blocks * block_size < context_lens)
        if short.size:
            i = int(short[0])
            raise ValueError(
                f"sequence {i}: {num_blocks[i]} blocks of {block_size} cannot hold "
                f"{context_lens[i]} tokens"
            )
        tables = np.full((b, width), -1, dtype=np.int32)
        tables[np.arange(width) < num_blocks[:, None]] = flat
        num_rows = int(seq_lens.sum())
        input_ids = np.fromiter(chain.from_iterable(new_token_ids), dtype=np.int64, count=num_rows)
        seq_of_row = np.repeat(np.arange(b), seq_lens)  # [T]
        positions = _positions(seq_lens, cached)
        blocks = tables[seq_of_row, positions // block_size].astype(np.int64)
        slot_mapping = blocks * block_size + positions % block_size
        last_rows = np.cumsum(seq_lens) - 1
        logits_indices = last_rows if sample is None else last_rows[np.asarray(sample, dtype=bool)]
        return cls(
            torch.from_numpy(input_ids),
            torch.from_numpy(positions),
            torch.from_numpy(seq_lens.astype(np.int32)),
            torch.from_numpy(context_lens.astype(np.int32)),
            torch.from_numpy(tables),
            torch.from_numpy(slot_mapping),
            torch.from_numpy(np.ascontiguousarray(logits_indices)),
        )


def _positions(seq_lens: NDArray[Any], num_cached: NDArray[Any]) -> NDArray[np.int64]:
    """[T] int64: num_cached[b], num_cached[b] + 1, ... for each sequence's new tokens."""
    lens = seq_lens.astype(np.int64)
    seq_of_row = np.repeat(np.arange(lens.shape[0]), lens)  # [T]
    starts = np.cumsum(lens) - lens  # [B], first row of each sequence
    return np.arange(int(lens.sum())) - starts[seq_of_row] + num_cached.astype(np.int64)[seq_of_row]
