"""Prefill attention (kernels/prefill_attention.py) against a float32 reference: every
key from the pool, and a chunk's own keys from a qkv-shaped tensor (`new_kv`, as the
model passes them for a quantized pool). Through Triton's interpreter without CUDA, as
test_turbo_kernels.py runs the other kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import (
    DEVICE,
    DTYPES,
    TOLERANCE,
    Attention,
    attention_ref,
    random_tables,
    rel_err,
)

pytest.importorskip("triton")

from lmd.engine.turbo import kernels


@dataclass(frozen=True)
class PrefillCase:
    shape: Attention
    new: list[int]  # new tokens per sequence
    cached: list[int]  # tokens already in the pool before them
    window: int = 0


PREFILL_CASES = [
    PrefillCase(Attention(4, 2, 16, 4), [5, 1, 9], [0, 3, 7]),
    PrefillCase(Attention(9, 3, 64, 64), [130, 64, 1], [0, 64, 200]),
    PrefillCase(Attention(8, 8, 128, 16), [70], [33]),
    PrefillCase(Attention(8, 2, 64, 16), [150, 20], [0, 90], window=40),
    PrefillCase(Attention(6, 2, 96, 8), [33, 2], [0, 15]),
]


def check_prefill(case: PrefillCase, dtype: torch.dtype) -> None:
    shape, new = case.shape, case.new
    layer = 2
    contexts = [n + c for n, c in zip(new, case.cached, strict=True)]
    num_blocks = sum(-(-c // shape.block_size) for c in contexts) + 2
    kv = shape.pool(num_blocks, 3, dtype)
    tables, padded = random_tables(contexts, shape.block_size, num_blocks, seed=sum(new))
    q = torch.randn(sum(new), shape.heads, shape.head_dim, device=DEVICE).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale = shape.head_dim**-0.5
    args: dict[str, Any] = {
        "layer": layer,
        "block_tables": padded,
        "cu_seqlens": cu,
        "context_lens": torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        "max_seq_len": max(new),
        "scale": scale,
        "window": case.window,
    }
    out = kernels.prefill_attention(q, kv, **args)
    ref = attention_ref(
        q,
        kv,
        layer=layer,
        tables=tables,
        seq_lens=new,
        context_lens=contexts,
        scale=scale,
        window=case.window,
    )
    assert rel_err(out, ref) < TOLERANCE[dtype]
    # The new tokens' K and V read from a qkv-shaped tensor instead (as the model passes
    # them for a quantized pool): the same values, the same attention.
    fresh = torch.empty(sum(new), shape.heads + 2 * shape.kv_heads, shape.head_dim).to(DEVICE)
    fresh = fresh.to(dtype)
    token = 0
    for table, n, c in zip(tables, new, case.cached, strict=True):
        for j in range(c, c + n):
            block, offset = table[j // shape.block_size], j % shape.block_size
            fresh[token, shape.heads :] = kv[block, layer, :, offset].reshape(-1, shape.head_dim)
            token += 1
    new_kv = (fresh[:, shape.heads : -shape.kv_heads], fresh[:, -shape.kv_heads :])
    read_new = kernels.prefill_attention(q, kv, new_kv=new_kv, **args)
    assert rel_err(read_new, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_attention(case: PrefillCase, dtype: torch.dtype) -> None:
    check_prefill(case, dtype)
