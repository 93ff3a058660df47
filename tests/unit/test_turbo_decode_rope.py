"""kernels/decode_rope.py: decode attention that rotates q and the new k itself and writes
the new K/V (RopeWrite) against the two kernels it replaces (rotary_and_cache_write,
then decode_attention on the rotated q): the same output within the dtype's rounding,
the same keys and values in the pool, nothing else written. Triton's interpreter on CPU
tensors without CUDA, compiled on a GPU; skipped where triton is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import (
    DECODE_CASES,
    DEVICE,
    DTYPES,
    TOLERANCE,
    Attention,
    DecodeCase,
    random_tables,
    rel_err,
    rope_table,
)

pytest.importorskip("triton")

from lmd.engine.turbo import kernels
from lmd.engine.turbo.kernels import kv_quant

CASES = [
    *DECODE_CASES,
    DecodeCase(Attention(8, 2, 64, 16), [2, 9, 40], window=1, splits=2),  # only the new key
    # ... with tiles aligned to blocks: the tile before the new key has no visible key
    DecodeCase(Attention(8, 2, 64, 64), [2, 70, 130], window=1, splits=2),
    DecodeCase(Attention(4, 4, 32, 16), [16, 17, 33], splits=4),  # new key at a split's start
]


def run(
    case: DecodeCase, dtype: torch.dtype, qk_norm: bool, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention output, the pool after) of one decode step of `case`'s sequences."""
    shape, contexts = case.shape, case.contexts
    heads, kv_heads, head_dim, block_size = (
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.block_size,
    )
    num_blocks = sum(-(-c // block_size) for c in contexts) + 3
    torch.manual_seed(len(contexts) + head_dim)
    kv = shape.pool(num_blocks, 2, dtype)
    tables, padded = random_tables(contexts, block_size, num_blocks, seed=len(contexts))
    qkv = torch.randn(len(contexts), (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    positions = torch.tensor([max(c - 1, 0) for c in contexts], device=DEVICE)
    slots = torch.tensor(
        [t[(c - 1) // block_size] * block_size + (c - 1) % block_size if c else -1
         for t, c in zip(tables, contexts, strict=True)],
        device=DEVICE,
    )  # fmt: skip
    table = rope_table(4096, head_dim).to(DEVICE)
    norms = [torch.rand(head_dim, device=DEVICE).add(0.5).to(dtype) for _ in "qk"]
    q_norm, k_norm = (norms[0], norms[1]) if qk_norm else (None, None)
    parts = qkv.view(len(contexts), -1, head_dim)
    rope = None
    if fused:
        rope = kernels.RopeWrite(parts[:, heads:], positions, slots, table, q_norm, k_norm)
    else:
        kernels.rotary_and_cache_write(
            qkv, positions=positions, slot_mapping=slots, rope=table, kv=kv, layer=1,
            num_heads=heads, q_norm=q_norm, k_norm=k_norm,
        )  # fmt: skip
    out = kernels.decode_attention(
        parts[:, :heads],
        kv,
        layer=1,
        block_tables=padded,
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        scale=head_dim**-0.5,
        window=case.window,
        num_splits=case.splits,
        rope=rope,
    )
    return out, kv, slots


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_rotates_and_writes_as_the_rotary_kernel(
    case: DecodeCase, dtype: torch.dtype, qk_norm: bool
) -> None:
    fused, pool, slots = run(case, dtype, qk_norm, fused=True)
    separate, pool_ref, _ = run(case, dtype, qk_norm, fused=False)
    live = [i for i, c in enumerate(case.contexts) if c]
    assert rel_err(fused[live], separate[live].float()) < TOLERANCE[dtype]
    padding = [i for i, c in enumerate(case.contexts) if not c]
    assert not fused[padding].float().abs().sum()
    block_size = case.shape.block_size
    written = slots[slots >= 0]
    blocks, offsets = written // block_size, written % block_size
    assert torch.equal(pool[blocks, 1, 1, offsets], pool_ref[blocks, 1, 1, offsets])  # v
    # k as the rotary kernel makes it, up to the order of float32 sums (the head's norm)
    assert rel_err(pool[blocks, 1, 0, offsets], pool_ref[blocks, 1, 0, offsets]) < 1e-2
    # nothing else written: the other slots of every layer, and layer 0's
    rest = torch.ones(pool.shape[0], pool.shape[3], dtype=torch.bool, device=DEVICE)
    rest[blocks, offsets] = False
    assert torch.equal(pool.transpose(1, 3)[rest], pool_ref.transpose(1, 3)[rest])
    assert torch.equal(pool[:, [0]], pool_ref[:, [0]])


def test_rope_write_refuses_what_it_cannot_take() -> None:
    shape = Attention(4, 2, 16, 4)
    kv = shape.pool(4, 1, torch.float32)
    q = torch.zeros(2, 4 + 4, 16, device=DEVICE)
    table = rope_table(64, 16).to(DEVICE)
    ids = torch.zeros(2, dtype=torch.long, device=DEVICE)
    ones = torch.ones(2, dtype=torch.int32, device=DEVICE)
    call: dict[str, Any] = {
        "layer": 0,
        "block_tables": ones[:, None] * 0,
        "context_lens": ones,
        "scale": 1.0,
    }
    with pytest.raises(ValueError, match=r"\[B, 2 Hkv, D\]"):
        kernels.decode_attention(
            q[:, :4], kv, rope=kernels.RopeWrite(q[:, 4:6], ids, ids, table), **call
        )
    with pytest.raises(ValueError, match="come together"):
        norm = torch.ones(16, device=DEVICE)
        rope = kernels.RopeWrite(q[:, 4:], ids, ids, table, q_norm=norm)
        kernels.decode_attention(q[:, :4], kv, rope=rope, **call)
    _, codes, scales = kv_quant.quantized_pool(4, 1, 4, 2, 16, "int8", DEVICE)
    with pytest.raises(ValueError, match="16-bit pools only"):
        rope = kernels.RopeWrite(q[:, 4:], ids, ids, table)
        kernels.decode_attention(q[:, :4], codes, rope=rope, kv_scales=scales, **call)
