"""Quantized KV pools (kv_cache_dtype int8 and fp8): each block holds its codes, then their
float16 scales; a block is still one byte range, so migration moves it whole, at about
half the bytes of a 16-bit block."""

from __future__ import annotations

import pytest
import torch

from lmd import protocol
from lmd.engine.backend import BackendError
from lmd.engine.block_manager import BlockManager
from lmd.engine.kv_layout import KV_SCALE_DTYPE, QUANT_KV_DTYPES, bytes_per_block
from lmd.engine.kv_pool import KVPool
from lmd.engine.sequence import SamplingParams, Sequence
from lmd.migration.fake import FakeTransport
from lmd.migration.receiver import Receiver
from lmd.migration.sender import Outgoing, Sender

L, S, HKV, D = 2, 4, 2, 8  # layers, slots per block, KV heads, head dim
KINDS = list(QUANT_KV_DTYPES)


def pool(num_blocks: int, kind: str, buffer: memoryview | None = None) -> KVPool:
    return KVPool(
        num_blocks,
        num_layers=L,
        num_kv_heads=HKV,
        head_dim=D,
        block_size=S,
        dtype=torch.bfloat16,
        buffer=buffer,
        kv_cache_dtype=kind,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_holds_its_codes_then_their_scales(kind: str) -> None:
    p = pool(3, kind)
    values = L * 2 * S * HKV * D
    assert p.block_nbytes == values + L * 2 * S * HKV * 2
    assert p.kv.dtype == QUANT_KV_DTYPES[kind] and p.kv.shape == (3, L, 2, S, HKV, D)
    assert p.kv_scales is not None and p.kv_scales.dtype == KV_SCALE_DTYPE
    assert p.kv_scales.shape == (3, L, 2, S, HKV)
    raw = p.as_bytes()
    assert raw.numel() == 3 * p.block_nbytes
    # The last value of block 1 (layer 1, v, slot S-1, head 1) is its codes' last byte.
    p.kv.view(torch.uint8)[1, 1, 1, S - 1, HKV - 1, D - 1] = 7
    assert int(raw[p.block_nbytes + values - 1]) == 7
    # Block 2, layer 1, k, slot 2, head 1's scale: after block 2's codes, in [L, 2, S, Hkv].
    p.kv_scales[2, 1, 0, 2, 1] = 1.5
    offset = 2 * p.block_nbytes + values + (((1 * 2 + 0) * S + 2) * HKV + 1) * 2
    got = raw[offset : offset + 2].view(torch.float16)
    assert float(got[0]) == 1.5
    assert p.kv[0].is_contiguous() and p.kv.stride(0) == p.block_nbytes


def test_a_quantized_block_is_about_half_a_16_bit_one() -> None:
    # Llama-3-8B: 32 layers, 8 KV heads, 128 dims, 64 tokens: (128 + 2) / 256 of bf16.
    bf16 = bytes_per_block(32, 8, 128, 64, torch.bfloat16)
    int8 = bytes_per_block(32, 8, 128, 64, torch.bfloat16, kv_cache_dtype="int8")
    assert int8 * 256 == bf16 * 130
    assert bf16 / int8 >= 1.9  # the sequences a pool of the same memory holds


@pytest.mark.parametrize("kind", KINDS)
def test_a_shared_buffer_backs_a_quantized_pool(kind: str) -> None:
    nbytes = 4 * pool(1, kind).block_nbytes
    region = bytearray(nbytes)
    p = pool(4, kind, memoryview(region))
    assert p.kv_scales is not None
    p.kv_scales[3, 0, 1, 0, 0] = 2.0
    p.kv.view(torch.uint8)[3, 0, 0, 0, 0, 0] = 9
    assert region[3 * p.block_nbytes] == 9
    assert p.contiguous_ranges([2, 3]) == [(2 * p.block_nbytes, 2 * p.block_nbytes)]


def test_quantized_blocks_migrate_byte_exact_at_their_own_size() -> None:
    transport = FakeTransport()
    per_block = pool(1, "int8").block_nbytes
    sides = []
    for _ in range(2):
        region = transport.create_region(8 * per_block)
        sides.append((region, pool(8, "int8", memoryview(region)), BlockManager(8, S)))
    (pre_region, pre, pre_blocks), (dec_region, dec, dec_blocks) = sides
    receiver = Receiver(dec_blocks, eos_token_ids=[0], max_seq_len=100, timeout_s=10, vocab_size=50)
    sender = Sender(transport, pre_region, pre)
    dec_blocks.allocate(Sequence("filler", [1, 2, 3, 4, 5]))  # decode's ids differ

    prompt = list(range(1, 10))  # 3 blocks, the last partial
    receiver.reserve(
        protocol.Reserve("r", "prefill-0", "tokenizer-0", {}, protocol.pack_ids(prompt)), 7, 0.0
    )
    (granted,) = receiver.grant(0, 0.0)
    src = Sequence("r", prompt, SamplingParams())
    pre_blocks.allocate(src)
    gen = torch.Generator().manual_seed(0)
    assert pre.kv_scales is not None and dec.kv_scales is not None
    for b in src.block_table:
        codes = torch.randint(-127, 128, pre.kv[b].shape, generator=gen, dtype=torch.int8)
        pre.kv[b] = codes
        pre.kv_scales[b] = torch.rand(pre.kv_scales[b].shape, generator=gen).half()
    src.num_cached_tokens = len(prompt)
    out = Outgoing("r", "tokenizer-0", "decode-0", src, {}, 0.0)
    reserved = protocol.Reserved(
        "r", "decode-0", "fake", dec.block_nbytes, dec.num_blocks, 0, [],
        dec_region.descriptor(), protocol.pack_ids(granted.seq.block_table),
    )  # fmt: skip
    sender.accept(out, reserved)
    sender.submit(out, 0.0)
    assert out.ticket is not None and out.ticket.poll()
    assert out.ticket.nbytes == 3 * per_block
    for s, d in zip(src.block_table, granted.seq.block_table, strict=True):
        assert torch.equal(pre.kv[s], dec.kv[d])
        assert torch.equal(pre.kv_scales[s], dec.kv_scales[d])


def test_a_pool_of_another_block_size_in_bytes_is_refused() -> None:
    """Prefill with a 16-bit pool and decode with an int8 one cannot pair: the
    reservation's block_nbytes differs, and the sender refuses it."""
    transport = FakeTransport()
    region = transport.create_region(4 * pool(1, "int8").block_nbytes)
    int8_pool = pool(4, "int8", memoryview(region))
    bf16_region = transport.create_region(4 * bytes_per_block(L, HKV, D, S, torch.bfloat16))
    bf16 = KVPool(
        4, num_layers=L, num_kv_heads=HKV, head_dim=D, block_size=S, dtype=torch.bfloat16,
        buffer=memoryview(bf16_region),
    )  # fmt: skip
    assert int8_pool.block_nbytes != bf16.block_nbytes
    sender = Sender(transport, bf16_region, bf16)
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    BlockManager(4, S).allocate(seq)
    out = Outgoing("r", "tokenizer-0", "decode-0", seq, {}, 0.0)
    reserved = protocol.Reserved(
        "r", "decode-0", "fake", int8_pool.block_nbytes, 4, 0, [],
        region.descriptor(), protocol.pack_ids([0]),
    )  # fmt: skip
    with pytest.raises(Exception, match="bytes"):
        sender.accept(out, reserved)


def test_backends_without_quantized_kernels_refuse_by_name(tmp_path: object) -> None:
    from lmd.engine.backend import refuse_quantization

    with pytest.raises(BackendError, match="backend torch cannot quantize weights"):
        refuse_quantization("torch", "w4a16", "auto")
    with pytest.raises(BackendError, match="no int8 KV cache"):
        refuse_quantization("torch", None, "int8")
    refuse_quantization("fake", None, "int8", kv=True)  # reads no KV: any pool will do
