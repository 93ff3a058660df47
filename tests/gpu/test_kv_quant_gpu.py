"""The turbo kernels over a quantized KV pool (int8, fp8 e4m3), compiled on a GPU, in
bfloat16 and float16 at Llama-3-8B's head shape (32 q heads, 8 KV heads, head_dim 128,
blocks of 64 tokens) and contexts up to 2,048: the write quantizes bit for bit as
kv_quant.quantize_heads does, and decode and prefill attention match a float32
reference over the dequantized pool to the activation dtype's rounding. The small
shapes of tests/unit/test_turbo_kv_quant.py run here too, compiled. Skipped without
CUDA.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.turbo import kernels
from lmd.engine.turbo.kernels import kv_quant
from tests.unit.test_turbo_kernels import (
    TOLERANCE,
    attention_ref,
    random_tables,
    rel_err,
    rope_table,
)

pytestmark = pytest.mark.gpu
HALF = [torch.bfloat16, torch.float16]
KINDS = list(kv_quant.KV_KINDS)
H, HKV, D, S, L = 32, 8, 128, 64, 2  # Llama-3-8B's heads, blocks of 64, two layers
DEVICE = torch.device("cuda")


def quantized_pool(kind: str, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv, kv_scales) of random values of varied magnitude per head, and the float32
    pool [N, L, 2, S, Hkv, D] they read back."""
    shape = (num_blocks, L, 2, S, HKV, D)
    values = torch.randn(shape, device=DEVICE)
    values *= torch.rand((*shape[:-1], 1), device=DEVICE) * 4 + 0.1
    _, kv, scales = kv_quant.quantized_pool(num_blocks, L, S, HKV, D, kind, DEVICE)
    codes, s = kv_quant.quantize_heads(values, kind)
    kv.copy_(codes)
    scales.copy_(s)
    return kv, scales, kv_quant.dequantize_heads(codes, s)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", KINDS)
def test_rotary_write_at_llama3_shape(kind: str, dtype: torch.dtype, qk_norm: bool) -> None:
    num_tokens, num_blocks, layer = 700, 16, 1
    qkv = (torch.randn(num_tokens, (H + 2 * HKV) * D, device=DEVICE) * 3).to(dtype)
    slots = torch.randperm(num_blocks * S, device=DEVICE)[:num_tokens]
    slots[::50] = -1  # padding rows
    norms = [torch.rand(D, device=DEVICE).add(0.5).to(dtype) for _ in "qk"]
    args: dict[str, Any] = {
        "positions": torch.randint(0, 4096, (num_tokens,), device=DEVICE),
        "slot_mapping": slots,
        "rope": rope_table(4096, D, theta=500000.0).to(DEVICE),
        "layer": layer,
        "num_heads": H,
        "q_norm": norms[0] if qk_norm else None,
        "k_norm": norms[1] if qk_norm else None,
    }
    plain_qkv, quant_qkv = qkv.clone(), qkv.clone()
    plain = torch.zeros(num_blocks, L, 2, S, HKV, D, device=DEVICE)  # float32 k and v
    kernels.rotary_and_cache_write(plain_qkv, kv=plain, **args)
    _, kv, scales = kv_quant.quantized_pool(num_blocks, L, S, HKV, D, kind, DEVICE)
    kernels.rotary_and_cache_write(quant_qkv, kv=kv, kv_scales=scales, **args)

    assert torch.equal(quant_qkv, plain_qkv)
    real = slots >= 0
    blocks, offsets = slots[real] // S, slots[real] % S
    codes, ref_scales = kv_quant.quantize_heads(plain[blocks, layer, :, offsets], kind)
    got, got_scales = kv[blocks, layer, :, offsets], scales[blocks, layer, :, offsets]
    # Compiled apart, the two kernels may contract the rotation's products into FMAs
    # differently, and sum a head's squares (its RMS) in other orders: k differs by
    # float32 ulps, and a rare scale or code moves by one step (seen without the norms
    # too: one float16 scale in a run, its codes unchanged).
    assert ((got_scales.float() - ref_scales.float()).abs() <= ref_scales.float() / 1024).all()
    assert (got.view(torch.uint8) != codes.view(torch.uint8)).float().mean() < 1e-3
    deq, ref = (
        kv_quant.dequantize_heads(*pair) for pair in ((got, got_scales), (codes, ref_scales))
    )
    assert rel_err(deq, ref) < 1e-3


DECODE = [  # (contexts, window, splits)
    ([1, 63, 64, 65, 1000, 2048], 0, 1),
    ([2048], 0, 16),
    ([700, 3, 2000, 513], 0, 4),
    ([1500, 40, 0], 512, 8),  # a window; a padding row
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("contexts", "window", "splits"), DECODE)
def test_decode_at_llama3_shape(
    kind: str, dtype: torch.dtype, contexts: list[int], window: int, splits: int
) -> None:
    num_blocks = sum(-(-c // S) for c in contexts) + 2
    kv, scales, deq = quantized_pool(kind, num_blocks)
    tables, padded = random_tables(contexts, S, num_blocks, seed=splits)
    q = torch.randn(len(contexts), H + 2 * HKV, D, device=DEVICE).to(dtype)[:, :H]
    out = kernels.decode_attention(
        q,
        kv,
        layer=1,
        block_tables=padded,
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        scale=D**-0.5,
        window=window,
        num_splits=splits,
        kv_scales=scales,
    )
    live = [i for i, c in enumerate(contexts) if c]
    ref = attention_ref(
        q[live],
        deq,
        layer=1,
        tables=[tables[i] for i in live],
        seq_lens=[1] * len(live),
        context_lens=[contexts[i] for i in live],
        scale=D**-0.5,
        window=window,
    )
    assert rel_err(out[live], ref) < TOLERANCE[dtype]
    assert not out[[i for i, c in enumerate(contexts) if not c]].float().abs().sum()


PREFILL = [  # (new tokens, cached tokens, window)
    ([512, 512, 1], [0, 0, 700], 0),
    ([1024], [1000], 0),  # a chunk after a cached prefix
    ([700, 64], [500, 0], 256),
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("new", "cached", "window"), PREFILL)
def test_prefill_at_llama3_shape(
    kind: str, dtype: torch.dtype, new: list[int], cached: list[int], window: int
) -> None:
    contexts = [n + c for n, c in zip(new, cached, strict=True)]
    num_blocks = sum(-(-c // S) for c in contexts) + 1
    kv, scales, deq = quantized_pool(kind, num_blocks)
    tables, padded = random_tables(contexts, S, num_blocks, seed=sum(new))
    q = torch.randn(sum(new), H, D, device=DEVICE).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    out = kernels.prefill_attention(
        q,
        kv,
        layer=0,
        block_tables=padded,
        cu_seqlens=cu.to(DEVICE),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        max_seq_len=max(new),
        scale=D**-0.5,
        window=window,
        kv_scales=scales,
    )
    ref = attention_ref(
        q,
        deq,
        layer=0,
        tables=tables,
        seq_lens=new,
        context_lens=contexts,
        scale=D**-0.5,
        window=window,
    )
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("kind", KINDS)
def test_decode_replays_in_a_cuda_graph(kind: str) -> None:
    """No host sync on the quantized path: the decode step captures and replays."""
    contexts = [300, 1000]
    num_blocks = sum(-(-c // S) for c in contexts) + 1
    kv, _, _ = quantized_pool(kind, num_blocks)
    _, padded = random_tables(contexts, S, num_blocks, seed=3)
    q = torch.randn(2, H, D, device=DEVICE).to(torch.bfloat16)
    args: dict[str, Any] = {
        "layer": 1,
        "block_tables": padded,
        "context_lens": torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        "scale": D**-0.5,
        "num_splits": 4,
    }
    eager = kernels.decode_attention(q, kv, kv_scales=kv_quant.scales_of(kv), **args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.decode_attention(q, kv, kv_scales=kv_quant.scales_of(kv), **args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_small_shapes_compiled() -> None:
    """The CPU tests' cases, compiled on the GPU."""
    from tests.unit import test_turbo_kv_quant as small

    for kind in KINDS:
        small.test_pool_views_follow_the_block_layout(kind)
        for contexts, window, splits in small.DECODE:
            small.test_decode_over_a_quantized_pool(kind, contexts, window, splits)
        for new, cached, window in small.PREFILL:
            small.test_prefill_over_a_quantized_pool(kind, new, cached, window)
