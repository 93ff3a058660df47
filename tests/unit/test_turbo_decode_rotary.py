"""Decode attention given a `Rotary` (kernels/decode_attention.py): the rotary of q and k
and the write of the new k and v into the pool done in the attention's own launch give
what `Rotary.apply` and then decode attention give: the output, every byte of the pool
(16-bit, int8 and e4m3 codes with their scales), in one split or several (the split that
reads the new key writes it), merged by the last split or by the merge kernel, with
Qwen3's head norms and without, a padding row included. Heads that are not a power of
two take the two launches. Without CUDA through Triton's interpreter (test_turbo_kernels.py),
bit for bit; compiled (on a GPU, in bfloat16 too), within a rounding: the two kernels'
float32 arithmetic may contract or sum in another order (scripts/decode_rotary_diff.py, on
an H200: outputs at most 3e-4 of their largest apart, a few k values a last bit).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")
# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import (
    DEVICE,
    ON_CUDA,
    Attention,
    random_tables,
    rel_err,
    rope_table,
)

Pool = tuple[Tensor, Tensor, Tensor | None]  # its memory, kv, kv_scales or None
Result = tuple[Tensor, Tensor, Tensor]  # the output, the pool's memory, its values

from lmd.engine.turbo import kernels  # noqa: E402
from lmd.engine.turbo.kernels import kv_quant  # noqa: E402

CONTEXTS = [37, 1, 0, 64, 130]  # tokens per sequence with the new one; 0: a padding row
L, LAYER = 2, 1  # the pool's layers, the layer attended
# Float pools of q's dtype (bfloat16 only compiled: the interpreter's tl.dot refuses it),
# int8 and e4m3 codes over float32 q.
KINDS = ["float32", "float16", "int8", "fp8"] + (["bfloat16"] if ON_CUDA else [])
# Blocks of 16 (a tile of 64 keys spans blocks), Llama-3-8B's heads in blocks of 64.
SHAPES = [Attention(8, 2, 32, 16), Attention(32, 8, 128, 64)]


def decode_case(
    shape: Attention, kind: str, qk_norm: bool
) -> tuple[Tensor, Callable[[], Pool], dict[str, Any], dict[str, Any]]:
    """(qkv rows [B, (H + 2 Hkv) D], a function that gives a copy of one random pool, the
    Rotary's fields but kv and its scales, decode_attention's arguments but q, kv and
    its scales) for CONTEXTS; `kind` a float dtype's name or "int8" | "fp8" (codes and
    scales over float32 q)."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, S = shape.heads, shape.kv_heads, shape.head_dim, shape.block_size
    num_blocks = sum(-(-c // S) for c in CONTEXTS) + 2
    dims = (num_blocks, L, 2, S, kv_heads, head_dim)
    dtype = getattr(torch, kind) if kind not in kv_quant.KV_KINDS else torch.float32
    if kind in kv_quant.KV_KINDS:
        raw, kv, scales = kv_quant.quantized_pool(
            num_blocks, L, S, kv_heads, head_dim, kind, DEVICE
        )
        codes, s = kv_quant.quantize_heads(torch.randn(dims, device=DEVICE), kind)
        kv.copy_(codes)
        scales.copy_(s)

        def pool() -> Pool:
            copy = raw.clone()
            return copy, *kv_quant.pool_views(copy, L, S, kv_heads, head_dim, kind)
    else:
        kv = torch.randn(dims, device=DEVICE).to(dtype)

        def pool() -> Pool:
            copy = kv.clone()
            return copy, copy, None

    tables, padded = random_tables(CONTEXTS, S, num_blocks, seed=0)
    slots = [
        t[(c - 1) // S] * S + (c - 1) % S if c else -1
        for t, c in zip(tables, CONTEXTS, strict=True)
    ]
    qkv = torch.randn(len(CONTEXTS), (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    norms = [torch.rand(head_dim, device=DEVICE).add(0.5).to(dtype) for _ in "qk"]
    rotary = {
        "positions": torch.tensor([max(c - 1, 0) for c in CONTEXTS], device=DEVICE),
        "slot_mapping": torch.tensor(slots, device=DEVICE),
        "rope": rope_table(256, head_dim).to(DEVICE),
        "layer": LAYER,
        "num_heads": heads,
        "q_norm": norms[0] if qk_norm else None,
        "k_norm": norms[1] if qk_norm else None,
    }
    attention = {
        "layer": LAYER,
        "block_tables": padded,
        "context_lens": torch.tensor(CONTEXTS, dtype=torch.int32, device=DEVICE),
        "scale": head_dim**-0.5,
    }
    return qkv.to(dtype), pool, rotary, attention


def both_ways(shape: Attention, kind: str, qk_norm: bool, **more: Any) -> tuple[Result, Result]:
    """((output, the pool's memory, its values in float32) of Rotary.apply then
    decode_attention, the same given the Rotary), each on its own copy of the pool."""
    qkv, pool, fields, args = decode_case(shape, kind, qk_norm)
    results = []
    for fused in (False, True):
        rows, (memory, kv, scales) = qkv.clone(), pool()
        rotary = kernels.Rotary(kv=kv, kv_scales=scales, **fields)
        if not fused:
            rotary.apply(rows)
        q = rows.view(len(CONTEXTS), -1, shape.head_dim)[:, : shape.heads]
        out = kernels.decode_attention(
            q, kv, kv_scales=scales, **(args | more), rotary=rotary if fused else None
        )
        values = kv.float() if scales is None else kv_quant.dequantize_heads(kv, scales)
        results.append((out, memory, values))
    return results[0], results[1]


def assert_same(two: Result, fused: Result) -> None:
    """Bit for bit in the interpreter, within a rounding compiled (the module docstring)."""
    (out, memory, values), (fused_out, fused_memory, fused_values) = two, fused
    if ON_CUDA:
        assert rel_err(fused_out, out) < 1e-3
        assert rel_err(fused_values, values) < 1e-4  # a slot not written: ~1e-2
    else:
        assert torch.equal(fused_out, out)
        assert torch.equal(fused_memory, memory)  # the whole pool (with its scales)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=["blocks-of-16", "llama3-heads"])
def test_rotary_in_the_attention_launch_gives_the_two_launches_values(
    shape: Attention, kind: str, qk_norm: bool, splits: int
) -> None:
    two, fused = both_ways(shape, kind, qk_norm, num_splits=splits)
    assert_same(two, fused)
    assert not fused[0][CONTEXTS.index(0)].float().abs().sum()  # the padding row: zeros


def test_rotary_in_the_attention_launch_with_its_splits_merged_by_the_last() -> None:
    counts = torch.zeros(len(CONTEXTS) * 4, dtype=torch.int32, device=DEVICE)
    two, fused = both_ways(Attention(8, 4, 16, 16), "float16", False, num_splits=4, counts=counts)
    assert_same(two, fused)
    assert not counts.any()


def test_heads_of_no_power_of_two_take_the_rotary_launch() -> None:
    assert_same(*both_ways(Attention(6, 2, 24, 16), "float32", True, num_splits=2))


def test_a_rotary_of_another_pool_or_q_not_of_its_rows_is_refused() -> None:
    qkv, pool, fields, args = decode_case(SHAPES[0], "float32", False)
    q, (_, kv, _) = qkv.view(len(CONTEXTS), -1, 32)[:, :8], pool()
    rotary = kernels.Rotary(kv=kv.clone(), **fields)
    with pytest.raises(ValueError, match="rotary"):
        kernels.decode_attention(q, kv, **args, rotary=rotary)
    with pytest.raises(ValueError, match="qkv"):
        kernels.decode_attention(q.contiguous(), kv, **args, rotary=kernels.Rotary(kv=kv, **fields))


def test_more_sequences_than_the_kernel_rotates_take_the_rotary_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = importlib.import_module("lmd.engine.turbo.kernels.decode_attention")
    applied: list[None] = []
    apply = kernels.Rotary.apply
    monkeypatch.setattr(
        kernels.Rotary, "apply", lambda self, rows: applied.append(apply(self, rows))
    )
    monkeypatch.setattr(module, "ROTARY_MAX_SEQS", len(CONTEXTS) - 1)
    assert_same(*both_ways(SHAPES[0], "float16", True, num_splits=2))
    assert len(applied) == 2  # the two launches' rotary, then decode_attention's own
