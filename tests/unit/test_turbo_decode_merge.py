"""Decode attention's split merge (kernels/decode_attention.py): the last split program
of each (sequence, KV head) to finish merges the partials, counted in a per-device
buffer that must be zero again after every launch, or the next launch (a CUDA graph
replay reuses the same buffer) would merge too early or never.

Without CUDA these run on CPU through Triton's interpreter (test_turbo_kernels sets it
up); they check the bookkeeping and the merge's math, not the GPU's memory ordering.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")
# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import (
    DEVICE,
    TOLERANCE,
    Attention,
    attention_ref,
    random_tables,
    rel_err,
)

TOL = TOLERANCE[torch.float32]  # the inputs are float32: the float32 bound

from lmd.engine.turbo import kernels  # noqa: E402
from lmd.engine.turbo.kernels.decode_attention import split_counters  # noqa: E402


def decode_twice(
    shape: Attention, contexts: list[int], splits: int, *, heads_first: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Run decode attention twice on the same random inputs, checking after each call
    that every split counter is back to zero; returns both outputs and the float32
    reference of the live rows."""
    num_blocks = sum(-(-c // shape.block_size) for c in contexts) + 2
    kv = shape.pool(num_blocks, 2, torch.float32)
    tables, padded = random_tables(contexts, shape.block_size, num_blocks, seed=7)
    q = torch.randn(len(contexts), shape.heads, shape.head_dim, device=DEVICE)
    scale = shape.head_dim**-0.5
    outs = []
    for _ in range(2):
        outs.append(
            kernels.decode_attention(
                q,
                kv,
                layer=1,
                block_tables=padded,
                context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
                scale=scale,
                num_splits=splits,
                heads_first=heads_first,
            )
        )
        assert not split_counters(DEVICE, 1).any(), "a split counter left non-zero"
    live = [i for i, c in enumerate(contexts) if c]
    ref = attention_ref(
        q[live],
        kv,
        layer=1,
        tables=[tables[i] for i in live],
        seq_lens=[1] * len(live),
        context_lens=[contexts[i] for i in live],
        scale=scale,
        window=0,
    )
    return outs[0], outs[1], ref


@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize(
    ("shape", "splits"),
    [
        (Attention(12, 4, 64, 16), 8),  # a group of 3: padded to BLOCK_G rows
        (Attention(8, 1, 128, 64), 4),  # one KV head, a group of 8
        (Attention(4, 4, 32, 16), 16),  # no GQA; more splits than most sequences' tiles
    ],
)
def test_last_split_merges_and_resets_its_counter(
    shape: Attention, splits: int, heads_first: bool
) -> None:
    contexts = [300, 1, 129, 64]
    first, second, ref = decode_twice(shape, contexts, splits, heads_first=heads_first)
    assert rel_err(first, ref) < TOL
    assert torch.equal(first, second)  # the second launch merged the same partials


def test_padding_rows_give_zeros_with_splits() -> None:
    contexts = [0, 200, 0]
    first, second, ref = decode_twice(Attention(6, 2, 64, 16), contexts, splits=4)
    assert rel_err(first[[1]], ref) < TOL
    for out in (first, second):
        assert not out[[0, 2]].abs().sum()


def test_counter_buffer_is_kept_until_it_is_outgrown() -> None:
    """A CUDA graph replays with the counter buffer's address at capture: every launch
    that fits must get the same buffer, zeroed; a larger one, a new zeroed buffer."""
    kept = split_counters(DEVICE, 1)
    assert split_counters(DEVICE, kept.numel()).data_ptr() == kept.data_ptr()
    grown = split_counters(DEVICE, kept.numel() + 1)
    assert grown.numel() > kept.numel() and not grown.any()
    assert split_counters(DEVICE, 1).data_ptr() == grown.data_ptr()
