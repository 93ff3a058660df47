"""The torch backend against transformers itself: same weights, same greedy tokens.

Tiny random-weight models (fixed seed) run in a second each; the SmolLM2 test converts
the real GGUF once into a model cache and reuses it on later runs.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    PreTrainedModel,
)

from lmd.engine.backend import BackendError
from lmd.engine.backends import select_backend
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.model_source import resolve_model
from lmd.engine.torch_backend import TorchBackend, native_cpu
from lmd.engine.torch_backend.linear import FusedPart, PackedLinear, PackedWeight
from tests.models import TINY_SHAPE, hf_greedy, load_reference, random_prompts, save_tiny_llama

BLOCK_SIZE = 4  # small, so that prompts span several blocks and end mid-block
NUM_BLOCKS = 96
CPU = torch.device("cpu")


class Blocks:
    """A minimal block allocator: shuffled ids, so that tables are never contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], num_tokens: int) -> list[int]:
        while len(table) * BLOCK_SIZE < num_tokens:
            table.append(self.free.pop())
        return table


def greedy(
    backend: TorchBackend,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    chunk: int | None = None,
) -> list[list[int]]:
    """Greedy decoding of all prompts together through the paged path, as the engine
    does: prompts in chunks of `chunk` tokens (whole when None), then one step per token
    with every sequence in one decode batch."""
    shape = backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)
    kv = torch.zeros(shape, dtype=backend.dtype, device=backend.device)
    blocks = Blocks(NUM_BLOCKS)
    tables: list[list[int]] = [[] for _ in prompts]
    done = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        rows = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        pieces = [list(prompts[i][done[i] : done[i] + (chunk or len(prompts[i]))]) for i in rows]
        for i, piece in zip(rows, pieces, strict=True):
            blocks.grow(tables[i], done[i] + len(piece))
        last = [
            done[i] + len(piece) == len(prompts[i]) for i, piece in zip(rows, pieces, strict=True)
        ]
        batch = ForwardBatch.pack(
            pieces, [done[i] for i in rows], [tables[i] for i in rows], BLOCK_SIZE, last
        )
        logits = backend.forward(batch, kv)
        sampled = iter(logits.argmax(-1).tolist())
        for i, piece, is_last in zip(rows, pieces, last, strict=True):
            done[i] += len(piece)
            if is_last:
                outputs[i].append(next(sampled))
    while len(outputs[0]) < max_new_tokens:
        lens = [len(p) + len(o) for p, o in zip(prompts, outputs, strict=True)]
        for table, n in zip(tables, lens, strict=True):
            blocks.grow(table, n)
        batch = ForwardBatch.pack(
            [[o[-1]] for o in outputs], [n - 1 for n in lens], tables, BLOCK_SIZE
        )
        for out, token in zip(outputs, backend.forward(batch, kv).argmax(-1).tolist(), strict=True):
            out.append(token)
    return outputs


def run_alone(backend: TorchBackend, tokens: list[int], num_cached: int, kv: Tensor) -> Tensor:
    """Logits after the last of `tokens`, computing only those past the first
    `num_cached`, whose K/V `kv` already holds (the sequence owns blocks 0, 1, ...)."""
    table = list(range(-(-len(tokens) // BLOCK_SIZE)))
    batch = ForwardBatch.pack([tokens[num_cached:]], [num_cached], [table], BLOCK_SIZE)
    return backend.forward(batch, kv)[0]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llama(llama_dir: Path) -> TorchBackend:
    # fp32 GEMMs: batches, chunks and cached prefixes are held to fp32 rounding; the bf16
    # ones (cpu_matmul_dtype auto on a CPU with bf16 dot products) in test_torch_linear.py.
    return TorchBackend(llama_dir, CPU, torch.float32, cpu_matmul_dtype="float32")


@pytest.fixture(scope="module")
def llama_ref(llama_dir: Path) -> PreTrainedModel:
    return load_reference(llama_dir)


def test_greedy_equals_transformers_generate(
    llama: TorchBackend, llama_ref: PreTrainedModel
) -> None:
    prompts = random_prompts([5, 13, 29], llama.vocab_size)
    ours = greedy(llama, prompts, 32)
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_greedy(llama_ref, prompt, 32)


def test_packed_batch_equals_each_sequence_alone(llama: TorchBackend) -> None:
    # A fresh prompt, a chunk after 6 cached tokens, and decode steps after 2, 10 and 30
    # cached tokens (contexts of 1, 3 and 8 blocks: three decode buckets).
    seqs = random_prompts([9, 14, 3, 11, 31], llama.vocab_size, seed=2)
    cached = [0, 6, 2, 10, 30]
    pools = [torch.zeros(llama.kv_cache_shape(8, BLOCK_SIZE)) for _ in seqs]
    for seq, n, pool in zip(seqs, cached, pools, strict=True):
        if n:
            run_alone(llama, seq[:n], 0, pool)
    alone = [
        run_alone(llama, seq, n, pool.clone())
        for seq, n, pool in zip(seqs, cached, pools, strict=True)
    ]
    # The same sequences in one batch and one pool: sequence k owns blocks 8k..8k+7.
    kv = torch.cat(pools)
    tables = [list(range(k * 8, k * 8 + -(-len(s) // BLOCK_SIZE))) for k, s in enumerate(seqs)]
    new = [seq[n:] for seq, n in zip(seqs, cached, strict=True)]
    packed = llama.forward(ForwardBatch.pack(new, cached, tables, BLOCK_SIZE), kv)
    for row, single in zip(packed, alone, strict=True):
        torch.testing.assert_close(row, single, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_equals_unchunked(llama: TorchBackend) -> None:
    prompts = random_prompts([23, 17], llama.vocab_size, seed=3)
    assert greedy(llama, prompts, 12, chunk=7) == greedy(llama, prompts, 12)
    kv = torch.zeros(llama.kv_cache_shape(8, BLOCK_SIZE))
    whole = run_alone(llama, prompts[0], 0, kv.clone())
    for cached, end in ((0, 7), (7, 16), (16, 23)):  # chunks of 7, 9 and 7 tokens
        logits = run_alone(llama, prompts[0][:end], cached, kv)
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)


def test_prefix_from_cached_blocks_gives_same_logits(llama: TorchBackend) -> None:
    shared, tail_a, tail_b = random_prompts([12, 5, 7], llama.vocab_size, seed=4)
    kv = torch.zeros(llama.kv_cache_shape(16, BLOCK_SIZE))
    # Sequence A fills blocks 0-2 with the shared prefix (3 full blocks) and 3-4 with its tail.
    batch = ForwardBatch.pack([shared + tail_a], [0], [[0, 1, 2, 3, 4]], BLOCK_SIZE)
    llama.forward(batch, kv)
    # Sequence B reuses blocks 0-2 and computes only its own tail, in blocks 9-10.
    reused = ForwardBatch.pack([tail_b], [12], [[0, 1, 2, 9, 10]], BLOCK_SIZE)
    hit = llama.forward(reused, kv)[0]
    fresh = run_alone(llama, shared + tail_b, 0, torch.zeros_like(kv))
    torch.testing.assert_close(hit, fresh, rtol=1e-5, atol=1e-5)


def test_sliding_window_and_softcap_match_transformers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = Gemma2Config(
        **TINY_SHAPE,
        head_dim=16,
        sliding_window=6,  # shorter than the prompts, so the window matters
        initializer_range=0.1,
    )
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    backend = TorchBackend(tmp_path, CPU, torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path, local_files_only=True, attn_implementation="eager"
    )
    prompts = random_prompts([5, 11, 17], backend.vocab_size, seed=5)
    for prompt, tokens in zip(prompts, greedy(backend, prompts, 16, chunk=8), strict=True):
        assert tokens == hf_greedy(ref, prompt, 16)


def test_bf16_on_cpu_agrees_with_transformers(llama_dir: Path) -> None:
    backend = TorchBackend(llama_dir, CPU, torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(
        llama_dir, local_files_only=True, dtype=torch.bfloat16
    )
    prompts = random_prompts([6, 19], backend.vocab_size, seed=6)
    kv = torch.zeros(backend.kv_cache_shape(16, BLOCK_SIZE), dtype=torch.bfloat16)
    batch = ForwardBatch.pack(prompts, [0, 0], [[0, 1], [2, 3, 4, 5, 6]], BLOCK_SIZE)
    ours = backend.forward(batch, kv)
    assert ours.dtype == torch.float32
    for prompt, row in zip(prompts, ours, strict=True):
        theirs = ref(torch.tensor([prompt])).logits[0, -1].float()
        assert int(row.argmax()) == int(theirs.argmax())
        torch.testing.assert_close(row, theirs, rtol=0.05, atol=0.05)


def test_model_facts(llama: TorchBackend) -> None:
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim) == (2, 2, 16)
    assert llama.vocab_size == 512 and llama.max_position_embeddings == 1024
    assert llama.eos_token_ids == (1,)
    assert llama.architecture == "LlamaForCausalLM"
    assert llama.kv_cache_shape(10, 64) == (10, 2, 2, 64, 2, 16)


def test_forward_writes_kv_into_the_mapped_slots(llama: TorchBackend) -> None:
    kv = torch.zeros(llama.kv_cache_shape(8, BLOCK_SIZE))
    batch = ForwardBatch.pack([[5, 6, 7, 8, 9]], [0], [[6, 3]], BLOCK_SIZE)
    llama.forward(batch, kv)
    written = kv.abs().sum(dim=(1, 2, 4, 5)) > 0  # [N, S]: which slots hold something
    expected = torch.zeros_like(written)
    expected[6, :] = True
    expected[3, 0] = True
    assert torch.equal(written, expected)


def test_forward_only_returns_requested_rows(llama: TorchBackend) -> None:
    kv = torch.zeros(llama.kv_cache_shape(8, BLOCK_SIZE))
    batch = ForwardBatch.pack([[1, 2, 3], [4, 5]], [0, 0], [[0], [1]], BLOCK_SIZE, [False, True])
    assert llama.forward(batch, kv).shape == (1, 512)
    empty = ForwardBatch.pack([], [], [], BLOCK_SIZE)
    assert llama.forward(empty, kv).shape == (0, 512)


def test_forward_rejects_a_pool_of_another_shape_or_dtype(llama: TorchBackend) -> None:
    batch = ForwardBatch.pack([[1, 2]], [0], [[0]], BLOCK_SIZE)
    with pytest.raises(ValueError, match="KV pool"):
        llama.forward(batch, torch.zeros(4, 2, 2, BLOCK_SIZE, 4, 16))
    with pytest.raises(ValueError, match="KV pool"):
        llama.forward(batch, torch.zeros(llama.kv_cache_shape(4, BLOCK_SIZE), dtype=torch.half))


def test_forward_rejects_blocks_outside_the_pool(llama: TorchBackend) -> None:
    kv = torch.zeros(llama.kv_cache_shape(4, BLOCK_SIZE))
    with pytest.raises(ValueError, match="block id 4 is outside the pool of 4"):
        llama.forward(ForwardBatch.pack([[1, 2]], [0], [[4]], BLOCK_SIZE), kv)


def test_pack_fills_positions_slots_and_logit_rows() -> None:
    batch = ForwardBatch.pack([[10, 11, 12], [13]], [2, 5], [[7, 2], [4, 9]], BLOCK_SIZE)
    assert batch.positions.tolist() == [2, 3, 4, 5]
    assert batch.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 9 * 4 + 1]
    assert batch.cu_seqlens.tolist() == [0, 3, 4]
    assert batch.context_lens.tolist() == [5, 6]
    assert batch.num_cached.tolist() == [2, 5]
    assert batch.logits_indices.tolist() == [2, 3]
    assert batch.block_tables.dtype == torch.int32


def test_pack_rejects_a_block_table_too_short() -> None:
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        ForwardBatch.pack([[1] * 5], [4], [[0, 1]], BLOCK_SIZE)
    with pytest.raises(ValueError, match="block ids must be >= 0"):
        ForwardBatch.pack([[1]], [0], [[-3]], BLOCK_SIZE)


def test_batch_rejects_positions_that_do_not_follow_the_cache() -> None:
    good = ForwardBatch.pack([[1, 2], [3]], [0, 4], [[0], [1, 2]], BLOCK_SIZE)
    with pytest.raises(ValueError, match="positions must run from num_cached"):
        ForwardBatch(
            good.input_ids,
            torch.tensor([0, 1, 3]),
            good.seq_lens,
            good.context_lens,
            good.block_tables,
            good.slot_mapping,
            good.logits_indices,
        )


def test_select_backend(caplog: pytest.LogCaptureFixture) -> None:
    assert select_backend("torch", "LlamaForCausalLM", "cpu") is TorchBackend
    with caplog.at_level(logging.WARNING):
        assert select_backend("auto", "LlamaForCausalLM", "cpu") is TorchBackend
    assert "turbo needs CUDA and the device is cpu" in caplog.text
    with pytest.raises(BackendError, match="backend turbo cannot run here"):
        select_backend("turbo", "LlamaForCausalLM", "cuda")
    with pytest.raises(BackendError, match="not one of"):
        select_backend("vllm", "LlamaForCausalLM", "cpu")


def test_smollm2_greedy_equals_transformers(smollm2_dir: Path) -> None:
    model = resolve_model(None)  # the conversion tests/conftest.py made, reused
    assert model.kind == "default" and model.path == smollm2_dir
    assert (model.path / "tokenizer.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Count to 5."]
    prompts = []
    for question in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
        )
        assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
        prompts.append([t for t in ids if isinstance(t, int)])
    backend = TorchBackend(model.path, CPU, torch.float32, cpu_matmul_dtype="float32")
    if native_cpu.supported():  # its GGUF's Q4_1 linears and Q8_0 lm_head decode as codes
        packed = packed_weights(backend)
        assert len(packed) == 1 + 30 * 7  # lm_head, q k v o gate up down of 30 layers
        codes = {name: weight.codes for name, weight in packed.items()}
        assert codes["lm_head"] is not None and codes["lm_head"].bits == 8
        assert all(c is not None and c.bits == 4 for n, c in codes.items() if n != "lm_head")
    ref = AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True)
    for prompt, tokens in zip(prompts, greedy(backend, prompts, 32, chunk=24), strict=True):
        assert tokens == hf_greedy(ref, prompt, 32)


def packed_weights(backend: TorchBackend) -> dict[str, PackedWeight]:
    return {
        name: (module.fused if isinstance(module, FusedPart) else module).packed_weight
        for name, module in backend.model.named_modules()
        if isinstance(module, PackedLinear | FusedPart)
    }


@pytest.mark.skipif(not native_cpu.pair_gemm_supported(), reason="the CPU has no AVX-512 BF16")
def test_smollm2_in_bf16_decodes_its_coded_linears_through_pair_gemm(smollm2_dir: Path) -> None:
    """cpu_matmul_dtype bfloat16: every coded linear's codes (Q4_1, and the lm_head's
    Q8_0) paired for pair_gemm, and a decode step's logits within bf16's rounding of the
    float32 model's."""
    fp32 = TorchBackend(smollm2_dir, CPU, torch.float32, cpu_matmul_dtype="float32")
    bf16 = TorchBackend(smollm2_dir, CPU, torch.float32, cpu_matmul_dtype="bfloat16")
    pairs = {name: weight.pairs for name, weight in packed_weights(bf16).items()}
    assert pairs["lm_head"] is not None and pairs["lm_head"].bits == 8
    assert all(p is not None and p.bits == 4 for n, p in pairs.items() if n != "lm_head")
    prompt = random_prompts([12], fp32.vocab_size, seed=3)[0]
    rows = []
    for backend in (fp32, bf16):
        kv = torch.zeros(backend.kv_cache_shape(2, 16))
        backend.forward(ForwardBatch.pack([prompt], [0], [[0]], 16), kv)  # 12 rows: decode kernels
        rows.append(backend.forward(ForwardBatch.pack([[prompt[-1]]], [12], [[0]], 16), kv)[0])
    # Logits up to ~33 apart by 0.09-0.15 at most over three prompts: twice that.
    torch.testing.assert_close(rows[1], rows[0], rtol=0, atol=0.3)
    assert not torch.equal(rows[1], rows[0])
