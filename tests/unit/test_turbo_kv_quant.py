"""The quantized KV pool (kernels/kv_quant.py) and the turbo kernels over it, int8 and
fp8 (e4m3), against torch references.

- The pool's two views land in the bytes of the decided block layout, and a block
  copied byte for byte (KV migration) reads back the same.
- rotary_and_cache_write quantizes exactly as kv_quant.quantize_heads does from the
  float32 k and v the unquantized kernel writes: the same codes, bit for bit (no
  off-by-one on ties: both round half to even), and the same float16 scales.
- Decode and prefill attention over a quantized pool equal the unquantized kernels run
  on a float32 pool holding the dequantized values: the same math up to float32
  rounding (the scale multiplies the score and the probability instead of the key
  and the value), so within relative 1e-5, the float32 bound of test_turbo_kernels.

Without CUDA these run on CPU through Triton's interpreter, which reads and writes
float8_e4m3fn (the kernel rounds to the e4m3 grid itself before its cast, which then
is exact everywhere), so fp8 is tested here like int8. tests/gpu/test_kv_quant_gpu.py
runs them compiled, in bfloat16 at Llama-3-8B's head shape. Skipped without triton.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")
# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import (
    DEVICE,
    TOLERANCE,
    Attention,
    random_tables,
    rel_err,
    rope_table,
)

L, S, HKV, H, D = 2, 16, 2, 4, 32  # layers, block size, KV heads, q heads, head_dim

from lmd.engine.turbo import kernels  # noqa: E402
from lmd.engine.turbo.kernels import kv_quant  # noqa: E402

KINDS = list(kv_quant.KV_KINDS)


def quantize_into(kv: Tensor, scales: Tensor, values: Tensor, kind: str) -> Tensor:
    """Store float32 values [N, L, 2, S, Hkv, D] into a quantized pool's views; return
    what it reads back (float32, the same shape)."""
    codes, s = kv_quant.quantize_heads(values, kind)
    kv.copy_(codes)
    scales.copy_(s)
    return kv_quant.dequantize_heads(codes, s)


# The pool --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_pool_views_follow_the_block_layout(kind: str) -> None:
    num_blocks = 3
    raw, kv, scales = kv_quant.quantized_pool(num_blocks, L, S, HKV, D, kind, DEVICE)
    nbytes = kv_quant.block_nbytes(L, S, HKV, D)
    assert raw.shape == (num_blocks, nbytes) and not raw.any()
    assert kv.dtype == kv_quant.KV_DTYPES[kind] and kv.shape == (num_blocks, L, 2, S, HKV, D)
    assert scales.dtype == torch.float16 and scales.shape == (num_blocks, L, 2, S, HKV)

    deq = quantize_into(kv, scales, torch.randn(kv.shape, device=DEVICE), kind)
    for b in range(num_blocks):  # the block's data [L, 2, S, Hkv, D], then its scales
        data = kv[b].contiguous().view(torch.uint8).flatten()
        scale_bytes = scales[b].contiguous().view(torch.uint8).flatten()
        assert torch.equal(raw[b], torch.cat([data, scale_bytes]))

    rebuilt = kv_quant.scales_of(kv)
    assert rebuilt.data_ptr() == scales.data_ptr() and rebuilt.stride() == scales.stride()
    assert torch.equal(rebuilt, scales)
    flat_kv, flat_scales = kv_quant.pool_views(raw.view(-1), L, S, HKV, D, kind)
    assert flat_kv.data_ptr() == kv.data_ptr() and torch.equal(flat_scales, scales)

    raw[2] = raw[0]  # KV migration copies whole blocks, scales included
    again = kv_quant.dequantize_heads(kv[2], scales[2])
    assert torch.equal(again, deq[0])


def test_pool_views_refuse_what_does_not_fit() -> None:
    raw, kv, scales = kv_quant.quantized_pool(2, L, S, HKV, D, "int8", DEVICE)
    with pytest.raises(ValueError, match="unknown KV quantization"):
        kv_quant.pool_views(raw, L, S, HKV, D, "int4")
    with pytest.raises(ValueError, match="blocks of"):
        kv_quant.pool_views(raw.view(-1)[:-1], L, S, HKV, D, "int8")
    with pytest.raises(ValueError, match="not the two views"):
        kv_quant.check_scales(kv, scales[:, :1])
    _, _, elsewhere = kv_quant.quantized_pool(2, L, S, HKV, D, "int8", DEVICE)
    with pytest.raises(ValueError, match="not the two views"):  # the kernels read kv's own
        kv_quant.check_scales(kv, elsewhere)
    with pytest.raises(ValueError, match="not the data view"):
        kv_quant.scales_of(kv[:, :1])
    q = torch.zeros(1, H, D, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="needs its kv_scales"):
        kernels.decode_attention(
            q, kv, layer=0, block_tables=one[:, None] * 0, context_lens=one, scale=1.0
        )


@pytest.mark.parametrize("kind", KINDS)
def test_reference_quantization_is_within_half_a_step(kind: str) -> None:
    x = torch.randn(64, 5, D) * torch.logspace(-6, 2, 64)[:, None, None]
    x[0, 0] = 0.0  # an all-zero head: codes 0, the smallest scale
    codes, scale = kv_quant.quantize_heads(x, kind)
    assert codes.dtype == kv_quant.KV_DTYPES[kind] and scale.dtype == torch.float16
    assert scale[0, 0] == kv_quant.SCALE_MIN and not codes[0, 0].float().any()
    err = (kv_quant.dequantize_heads(codes, scale) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    s = scale.float()[..., None]
    # int8: half a step; e4m3: half an ulp (3 mantissa bits), 2^-10 s in the subnormals.
    # Both: + amax 2^-10 where the float16 scale rounded down and the top value clamped.
    half_step = 0.5 * s if kind == "int8" else torch.maximum(x.abs() / 16, s / 1024)
    assert (err <= half_step + amax / 1024).all()


# Rotary: the write ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(torch.float32, Attention(H, HKV, D, S)), (torch.float16, Attention(6, 3, 48, S))],
)
def test_rotary_write_quantizes_like_the_reference(
    kind: str, qk_norm: bool, dtype: torch.dtype, shape: Attention
) -> None:
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    num_tokens, num_blocks, layer = 21, 4, 1
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    qkv[0, heads * head_dim : (heads + 1) * head_dim] = 0.0  # a zero k head
    qkv = (qkv * 3).to(dtype)
    positions = torch.randint(0, 200, (num_tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * S, device=DEVICE)[:num_tokens]
    slots[4] = -1  # a padding row: writes nothing
    norms = [torch.rand(head_dim, device=DEVICE).add(0.5).to(dtype) for _ in "qk"]
    args: dict[str, Any] = {
        "positions": positions,
        "slot_mapping": slots,
        "rope": rope_table(256, head_dim).to(DEVICE),
        "layer": layer,
        "num_heads": heads,
        "q_norm": norms[0] if qk_norm else None,
        "k_norm": norms[1] if qk_norm else None,
    }
    # The unquantized kernel into a float32 pool: k and v exactly as the kernel has them.
    plain_qkv, quant_qkv = qkv.clone(), qkv.clone()
    plain = torch.zeros(num_blocks, L, 2, S, kv_heads, head_dim, device=DEVICE)
    kernels.rotary_and_cache_write(plain_qkv, kv=plain, **args)
    _, kv, scales = kv_quant.quantized_pool(num_blocks, L, S, kv_heads, head_dim, kind, DEVICE)
    kernels.rotary_and_cache_write(quant_qkv, kv=kv, kv_scales=scales, **args)

    assert torch.equal(quant_qkv, plain_qkv)  # q and k rotated in place in either pool
    real = slots >= 0
    blocks, offsets = slots[real] // S, slots[real] % S
    codes, ref_scales = kv_quant.quantize_heads(plain[blocks, layer, :, offsets], kind)
    got = kv[blocks, layer, :, offsets]
    assert torch.equal(got.view(torch.uint8), codes.view(torch.uint8))  # bit for bit
    assert torch.equal(scales[blocks, layer, :, offsets], ref_scales)
    assert ref_scales[0, 0, 0] == kv_quant.SCALE_MIN  # the zero head
    written = torch.zeros(num_blocks, S, dtype=torch.bool, device=DEVICE)
    written[blocks, offsets] = True
    assert not kv[:, layer].transpose(1, 2)[~written].view(torch.uint8).any()
    assert not scales[:, layer].transpose(1, 2)[~written].any()
    assert not kv[:, 1 - layer].view(torch.uint8).any() and not scales[:, 1 - layer].any()


# Attention: the reads --------------------------------------------------------------


def quantized_pair(kind: str, num_blocks: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(kv, kv_scales) of a quantized pool of random values, and a float32 pool of the
    values they read back. Heads vary in magnitude, so scales do too."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (num_blocks, L, 2, S, HKV, D)
    values = torch.randn(shape, generator=gen, device=DEVICE)
    values *= torch.rand((*shape[:-1], 1), generator=gen, device=DEVICE) * 4 + 0.1
    _, kv, scales = kv_quant.quantized_pool(num_blocks, L, S, HKV, D, kind, DEVICE)
    return kv, scales, quantize_into(kv, scales, values, kind)


DECODE = [  # (contexts, window, splits)
    ([1, 17, 40], 0, 1),
    ([33, 50, 16], 20, 2),
    ([45, 0, 70], 0, 4),  # a padding row: zeros out
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("contexts", "window", "splits"), DECODE)
def test_decode_over_a_quantized_pool(
    kind: str, contexts: list[int], window: int, splits: int
) -> None:
    num_blocks = sum(-(-c // S) for c in contexts) + 2
    kv, scales, deq = quantized_pair(kind, num_blocks, seed=splits)
    _, tables = random_tables(contexts, S, num_blocks, seed=len(contexts))
    q = torch.randn(len(contexts), H + 2 * HKV, D, device=DEVICE)[:, :H]  # strided
    args: dict[str, Any] = {
        "layer": 1,
        "block_tables": tables,
        "context_lens": torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        "scale": D**-0.5,
        "window": window,
        "num_splits": splits,
    }
    out = kernels.decode_attention(q, kv, kv_scales=scales, **args)
    ref = kernels.decode_attention(q, deq, **args)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    assert not out[[i for i, c in enumerate(contexts) if not c]].any()
    # float16 activations: codes convert exactly, the rest is float16 rounding.
    out16 = kernels.decode_attention(q.half(), kv, kv_scales=scales, **args)
    assert out16.dtype == torch.float16
    assert rel_err(out16, ref) < TOLERANCE[torch.float16]


PREFILL = [  # (new tokens, cached tokens, window)
    ([5, 20, 1], [0, 13, 30], 0),
    ([40, 3], [7, 16], 12),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("new", "cached", "window"), PREFILL)
def test_prefill_over_a_quantized_pool(
    kind: str, new: list[int], cached: list[int], window: int
) -> None:
    contexts = [n + c for n, c in zip(new, cached, strict=True)]
    num_blocks = sum(-(-c // S) for c in contexts) + 1
    kv, scales, deq = quantized_pair(kind, num_blocks, seed=window)
    blocks, tables = random_tables(contexts, S, num_blocks, seed=sum(new))
    q = torch.randn(sum(new), H, D, device=DEVICE)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    args: dict[str, Any] = {
        "layer": 0,
        "block_tables": tables,
        "cu_seqlens": cu.to(DEVICE),
        "context_lens": torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        "max_seq_len": max(new),
        "scale": D**-0.5,
        "window": window,
    }
    out = kernels.prefill_attention(q, kv, kv_scales=scales, **args)
    assert rel_err(out, kernels.prefill_attention(q, deq, **args)) < TOLERANCE[torch.float32]
    # The prompt's own K and V unquantized (new_kv, as the model passes them): the cached
    # prefix read back from the codes, the new tokens exact.
    fresh = torch.randn(sum(new), 3 * HKV, D, device=DEVICE)[:, HKV:]  # k | v heads
    exact = deq.clone()
    token = 0
    for table, n, c in zip(blocks, new, cached, strict=True):
        for j in range(c, c + n):
            exact[table[j // S], 0, :, j % S] = fresh[token].view(2, HKV, D)
            token += 1
    out = kernels.prefill_attention(
        q, kv, kv_scales=scales, new_kv=(fresh[:, :HKV], fresh[:, HKV:]), **args
    )
    assert rel_err(out, kernels.prefill_attention(q, exact, **args)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(("kind", "bound"), [("int8", 0.02), ("fp8", 0.08)])
def test_written_then_read_attention_stays_close(kind: str, bound: float) -> None:
    """rotary_and_cache_write then decode_attention: a quantized pool's output is within
    the quantization's error of the float32 pool's (int8 ~1%, e4m3 ~4%)."""
    torch.manual_seed(0)
    contexts, num_blocks = [37, 20], 5
    slots = torch.cat([torch.arange(0, 37), torch.arange(48, 68)]).to(DEVICE)
    positions = torch.cat([torch.arange(37), torch.arange(20)]).to(DEVICE)
    qkv = torch.randn(slots.shape[0], (H + 2 * HKV) * D, device=DEVICE)
    rope = rope_table(64, D).to(DEVICE)
    common: dict[str, Any] = {
        "positions": positions,
        "slot_mapping": slots,
        "rope": rope,
        "layer": 1,
    }
    plain = torch.zeros(num_blocks, L, 2, S, HKV, D, device=DEVICE)
    kernels.rotary_and_cache_write(qkv.clone(), kv=plain, num_heads=H, **common)
    _, kv, scales = kv_quant.quantized_pool(num_blocks, L, S, HKV, D, kind, DEVICE)
    kernels.rotary_and_cache_write(qkv.clone(), kv=kv, kv_scales=scales, num_heads=H, **common)
    tables = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, H, D, device=DEVICE) * 3  # peaked enough that keys matter
    args: dict[str, Any] = {
        "layer": 1,
        "block_tables": tables,
        "context_lens": torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        "scale": D**-0.5,
    }
    out = kernels.decode_attention(q, kv, kv_scales=scales, **args)
    assert rel_err(out, kernels.decode_attention(q, plain, **args)) < bound
