"""Decode attention over the paged pool in lmd._native (native/paged_attention.h, as
engine/torch_backend/attention.py calls it) against the same attention in float64:
grouped query heads, head dims on and off the kernel's 8 lanes, windows, tables padded
past a sequence's blocks, one thread and two; and its refusals."""

from __future__ import annotations

import pytest
import torch

from lmd.engine.torch_backend import native_cpu
from lmd.engine.torch_backend.attention import DecodeRows, _native_decode

pytestmark = pytest.mark.skipif(not native_cpu.supported(), reason="needs AVX2 and FMA")

BLOCKS, LAYERS, BLOCK_SIZE = 40, 3, 4


def reference(
    kv: torch.Tensor, dec: DecodeRows, q: torch.Tensor, layer: int, window: int | None
) -> torch.Tensor:
    """q: [Bd, Hkv, G, D] -> the same, in float64 by the definition."""
    bd, _, _, dim = q.shape
    tables = dec.block_ids.view(bd, dec.num_blocks)
    out = torch.empty(q.shape, dtype=torch.float64)
    for row in range(bd):
        pos = int(dec.positions[row])
        keys = torch.arange(pos + 1)
        if window is not None:
            keys = keys[pos - keys < window]
        blocks, slots = tables[row, keys // BLOCK_SIZE], keys % BLOCK_SIZE
        k = kv[blocks, layer, 0, slots].double()  # [n, Hkv, D]
        v = kv[blocks, layer, 1, slots].double()
        scores = torch.einsum("hgd,nhd->hgn", q[row].double(), k) * dim**-0.5
        out[row] = torch.einsum("hgn,nhd->hgd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("heads_kv", "groups", "dim", "window"),
    [(3, 3, 64, None), (2, 1, 40, None), (4, 2, 16, 5), (2, 4, 128, None), (1, 2, 12, None)],
)
def test_native_decode_equals_the_definition(
    heads_kv: int, groups: int, dim: int, window: int | None, threads: int
) -> None:
    torch.manual_seed(heads_kv * dim)
    kv = torch.randn(BLOCKS, LAYERS, 2, BLOCK_SIZE, heads_kv, dim)
    # Keys visible (position + 1): runs of 8 keys and the rest, 8 apart and within them.
    lengths = [1, 6, 13, 20, 9, 8, 39]
    width = 10  # blocks per table row: 40 keys; shorter rows padded with block 0
    tables = torch.zeros(len(lengths), width, dtype=torch.int64)
    for row, n in enumerate(lengths):
        need = -(-n // BLOCK_SIZE)
        tables[row, :need] = torch.randperm(BLOCKS)[:need]
    dec = DecodeRows(
        -1,
        torch.arange(len(lengths)),
        tables.flatten(),
        width,
        torch.tensor([n - 1 for n in lengths]),
    )
    q = torch.randn(len(lengths), groups, heads_kv, dim).transpose(1, 2)  # strided, as the model's
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _native_decode(kv, dec, q, 1, window=window, scaling=None)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.double(), reference(kv, dec, q, 1, window), rtol=1e-5, atol=1e-5)


def test_native_decode_refuses_a_block_outside_the_pool_or_a_position_past_the_table() -> None:
    kv = torch.randn(BLOCKS, LAYERS, 2, BLOCK_SIZE, 2, 8)
    q = torch.randn(1, 2, 1, 8)
    outside = DecodeRows(-1, torch.arange(1), torch.tensor([BLOCKS]), 1, torch.tensor([2]))
    with pytest.raises(ValueError, match="block 40 is outside the pool of 40"):
        _native_decode(kv, outside, q, 0, window=None, scaling=None)
    past = DecodeRows(-1, torch.arange(1), torch.tensor([3]), 1, torch.tensor([BLOCK_SIZE]))
    with pytest.raises(ValueError, match="position 4 of row 0 is past its 1 blocks"):
        _native_decode(kv, past, q, 0, window=None, scaling=None)
