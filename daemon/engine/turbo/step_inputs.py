"""One step's inputs on the model's device: the packed batch (ForwardBatch) moved there,
with the host-side decisions of the step (decode or prompt rows, decode attention's
splits) made once. CUDA graphs replay over static buffers of this shape (graphs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.turbo import kernels


@dataclass(slots=True)
class StepInputs:
    """One step's inputs on the model's device (static buffers when a graph replays)."""

    input_ids: Tensor  # [T] int64 (int32 in a graph)
    positions: Tensor  # [T] int64 (int32 in a graph)
    slot_mapping: Tensor  # [T] int64 (int32 in a graph), < 0 = padding row (no write)
    block_tables: Tensor  # [B, W] int32
    context_lens: Tensor  # [B] int32, 0 = padding row
    cu_seqlens: Tensor | None  # [B + 1] int32; None for a decode step (one token each)
    logits_indices: Tensor | None  # [R] int64 rows to return; None = every row
    max_seq_len: int  # longest run of new tokens of one sequence; 1 = decode step
    num_splits: int  # decode attention's context splits

    @property
    def is_decode(self) -> bool:
        return self.max_seq_len == 1

    @classmethod
    def from_batch(
        cls, batch: ForwardBatch, device: torch.device, num_kv_heads: int, num_sms: int
    ) -> StepInputs:
        """Move a packed batch to the device; the host-side decisions are made here."""
        seq_lens = batch.seq_lens
        max_seq_len = int(seq_lens.max())
        rows = batch.logits_indices
        every_row = rows.shape[0] == batch.num_tokens and (
            rows.device.type != "cpu" or torch.equal(rows, torch.arange(batch.num_tokens))
        )
        is_decode = max_seq_len == 1
        splits = 1
        if is_decode:
            max_context = int(batch.context_lens.max())
            splits = kernels.decode_splits(batch.num_seqs, num_kv_heads, max_context, num_sms)

        def dev(t: Tensor, dtype: torch.dtype) -> Tensor:
            return t.to(device=device, dtype=dtype, non_blocking=True)

        return cls(
            input_ids=dev(batch.input_ids, torch.int64),
            positions=dev(batch.positions, torch.int64),
            slot_mapping=dev(batch.slot_mapping, torch.int64),
            block_tables=dev(batch.block_tables, torch.int32),
            context_lens=dev(batch.context_lens, torch.int32),
            cu_seqlens=None if is_decode else dev(batch.cu_seqlens, torch.int32),
            logits_indices=None if every_row else dev(rows, torch.int64),
            max_seq_len=max_seq_len,
            num_splits=splits,
        )
