"""The turbo decoder end to end against transformers, on tiny random-weight models.

Without CUDA the Triton kernels run on CPU through Triton's interpreter in float32,
where turbo must match transformers to float32 rounding: same logits at every position,
same greedy tokens, chunked prefill, packed batches, prefix blocks, Qwen2 biases,
Mistral's sliding window, tied embeddings, and turbo prefill continued by the torch
backend. With CUDA the same checks run compiled (tests/gpu adds the bf16 criteria).
Skipped where triton is not installed (CI).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

pytest.importorskip("triton")
# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import ON_CUDA

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")  # (keeps the imports below after it)

from lmd.engine.backend import Backend  # noqa: E402
from lmd.engine.forward_batch import ForwardBatch  # noqa: E402
from lmd.engine.torch_backend import TorchBackend  # noqa: E402
from lmd.engine.turbo.backend import TurboBackend  # noqa: E402
from tests.models import TINY_SHAPE, hf_greedy, random_prompts, save_tiny_llama  # noqa: E402

BLOCK_SIZE = 4  # small: prompts span several blocks and end mid-block
# The interpreter is slow: fewer tokens on CPU; the 32 with CUDA.
NEW_TOKENS = 32 if ON_CUDA else 12
NUM_BLOCKS = 128


class Blocks:
    """Shuffled free block ids, so that block tables are never contiguous."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], num_tokens: int, block_size: int = BLOCK_SIZE) -> list[int]:
        while len(table) * block_size < num_tokens:
            table.append(self.free.pop())
        return table


def new_pool(
    backend: Backend, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE
) -> Tensor:
    shape = backend.kv_cache_shape(num_blocks, block_size)
    return torch.randn(shape, device=backend.device).to(backend.dtype)  # never zeros


def all_logits(backend: Backend, prompts: Sequence[Sequence[int]], kv: Tensor) -> list[Tensor]:
    """Float32 logits at every position of every prompt, the prompts in one batch."""
    block_size = kv.shape[3]
    blocks = Blocks(kv.shape[0])
    tables = [blocks.grow([], len(p), block_size) for p in prompts]
    batch = ForwardBatch.pack([list(p) for p in prompts], [0] * len(prompts), tables, block_size)
    batch.logits_indices = torch.arange(batch.num_tokens)
    logits = backend.forward(batch, kv)
    return list(torch.split(logits, [len(p) for p in prompts]))


def on_device(model: PreTrainedModel) -> PreTrainedModel:
    moved: PreTrainedModel = model.to(DEVICE)  # type: ignore[arg-type]  # decorated .to()
    moved.train(False)
    return moved


def reference_logits(ref: PreTrainedModel, prompts: Sequence[Sequence[int]]) -> list[Tensor]:
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], device=ref.device)
            out.append(ref(ids).logits[0].float())
    return out


def greedy(
    prefill: Backend,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    chunk: int | None = None,
    decode: Backend | None = None,
    kv: Tensor | None = None,
    force: Sequence[Sequence[int]] | None = None,
    logits: list[Tensor] | None = None,
) -> list[list[int]]:
    """Greedy decoding as the engine runs it: prompts in chunks of `chunk` tokens on
    `prefill`, then one decode step per token for all sequences on `decode` (default
    the same backend), all in one KV pool (default: a fresh one of blocks of 4).

    With `force` (teacher forcing), decode step t feeds force[b][t] instead of the
    token chosen before; the chosen tokens are still what it returns. `logits`, when
    given, gets each decode step's logits ([B, V] float32 on the host).
    """
    decoder = decode or prefill
    kv = new_pool(prefill) if kv is None else kv
    block_size = kv.shape[3]
    blocks = Blocks(kv.shape[0])
    tables: list[list[int]] = [[] for _ in prompts]
    done = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        rows = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        pieces = [list(prompts[i][done[i] : done[i] + (chunk or len(prompts[i]))]) for i in rows]
        for i, piece in zip(rows, pieces, strict=True):
            blocks.grow(tables[i], done[i] + len(piece), block_size)
        last = [done[i] + len(p) == len(prompts[i]) for i, p in zip(rows, pieces, strict=True)]
        batch = ForwardBatch.pack(
            pieces, [done[i] for i in rows], [tables[i] for i in rows], block_size, last
        )
        sampled = iter(prefill.forward(batch, kv).argmax(-1).tolist())
        for i, piece, is_last in zip(rows, pieces, last, strict=True):
            done[i] += len(piece)
            if is_last:
                outputs[i].append(next(sampled))
    while len(outputs[0]) < max_new_tokens:
        lens = [len(p) + len(o) for p, o in zip(prompts, outputs, strict=True)]
        for table, n in zip(tables, lens, strict=True):
            blocks.grow(table, n, block_size)
        fed = [
            [f[len(o) - 1] if force else o[-1]]
            for f, o in zip(force or outputs, outputs, strict=True)
        ]
        batch = ForwardBatch.pack(fed, [n - 1 for n in lens], tables, block_size)
        step = decoder.forward(batch, kv)
        if logits is not None:
            logits.append(step.float().cpu())
        for out, token in zip(outputs, step.argmax(-1).tolist(), strict=True):
            out.append(token)
    return outputs


def assert_logits_match(ours: list[Tensor], ref: list[Tensor], max_rel: float) -> None:
    rel = float(torch.cat(ours).sub(torch.cat(ref)).norm() / torch.cat(ref).norm())
    assert rel < max_rel, f"relative error {rel:.2e}"
    top1 = torch.cat(ours).argmax(-1).eq(torch.cat(ref).argmax(-1)).float().mean()
    assert float(top1) == 1.0


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 6 heads over 2 KV heads (GQA groups of 3, as SmolLM2), head_dim 16.
    return save_tiny_llama(
        tmp_path_factory.mktemp("turbo-llama"),
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        initializer_range=0.05,
    )


@pytest.fixture(scope="module")
def turbo(llama_dir: Path) -> TurboBackend:
    return TurboBackend(llama_dir, DEVICE, torch.float32)


@pytest.fixture(scope="module")
def llama_ref(llama_dir: Path) -> PreTrainedModel:
    return on_device(
        AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True, dtype=torch.float32)
    )


def test_logits_at_every_position_match_transformers(
    turbo: TurboBackend, llama_ref: PreTrainedModel
) -> None:
    prompts = random_prompts([1, 5, 17, 33, 70, 8, 4, 12], turbo.vocab_size, seed=11)
    assert_logits_match(
        all_logits(turbo, prompts, new_pool(turbo)), reference_logits(llama_ref, prompts), 1e-4
    )


def test_greedy_equals_transformers_generate(
    turbo: TurboBackend, llama_ref: PreTrainedModel
) -> None:
    prompts = random_prompts([5, 13, 29], turbo.vocab_size, seed=12)
    for prompt, tokens in zip(prompts, greedy(turbo, prompts, 24, chunk=6), strict=True):
        assert tokens == hf_greedy(llama_ref, prompt, 24)


def test_one_row_steps_with_the_norms_fused_in(llama_dir: Path) -> None:
    """Steps of one row through kernels/vector_gemv.py (fused_batch1: the RMSNorms made
    in the products' launches, as CUDA would run them in half precision) against the
    separate kernels: per-step logits at float16 rounding, same greedy tokens. A
    one-token prompt makes its prefill a one-row step too."""
    plain = TurboBackend(llama_dir, DEVICE, torch.float16, cuda_graphs=False)
    fused = TurboBackend(llama_dir, DEVICE, torch.float16, cuda_graphs=False)
    fused.model.skinny = fused.model.fused_batch1 = True
    for prompt in random_prompts([1, 13], plain.vocab_size, seed=14):
        plain_logits: list[Tensor] = []
        fused_logits: list[Tensor] = []
        tokens = greedy(plain, [prompt], 8, logits=plain_logits)
        forced = greedy(fused, [prompt], 8, force=tokens, logits=fused_logits)
        assert_logits_match(fused_logits, plain_logits, 5e-3)
        assert forced == tokens


def test_packed_batch_equals_each_sequence_alone(turbo: TurboBackend) -> None:
    # A fresh prompt, a chunk after a prefix, decode steps after short and long contexts.
    seqs = random_prompts([9, 14, 3, 11, 31], turbo.vocab_size, seed=13)
    cached = [0, 6, 2, 10, 30]
    kv = new_pool(turbo)
    blocks = Blocks()
    tables = [blocks.grow([], len(s)) for s in seqs]
    for seq, n, table in zip(seqs, cached, tables, strict=True):
        if n:
            turbo.forward(ForwardBatch.pack([seq[:n]], [0], [table], BLOCK_SIZE), kv)
    alone = [
        turbo.forward(ForwardBatch.pack([seq[n:]], [n], [table], BLOCK_SIZE), kv.clone())[0]
        for seq, n, table in zip(seqs, cached, tables, strict=True)
    ]
    new = [seq[n:] for seq, n in zip(seqs, cached, strict=True)]
    packed = turbo.forward(ForwardBatch.pack(new, cached, tables, BLOCK_SIZE), kv)
    for row, single in zip(packed, alone, strict=True):
        torch.testing.assert_close(row, single, rtol=1e-4, atol=1e-4)


def test_prefix_from_cached_blocks_gives_same_logits(turbo: TurboBackend) -> None:
    shared, tail_a, tail_b = random_prompts([12, 5, 7], turbo.vocab_size, seed=14)
    kv = new_pool(turbo)
    turbo.forward(ForwardBatch.pack([shared + tail_a], [0], [[7, 1, 2, 3, 4]], BLOCK_SIZE), kv)
    # B reuses A's three full prefix blocks and computes only its tail.
    hit = turbo.forward(ForwardBatch.pack([tail_b], [12], [[7, 1, 2, 9, 10]], BLOCK_SIZE), kv)
    fresh = turbo.forward(
        ForwardBatch.pack([shared + tail_b], [0], [[20, 21, 22, 23, 24]], BLOCK_SIZE), kv
    )
    torch.testing.assert_close(hit, fresh, rtol=1e-4, atol=1e-4)


def test_turbo_prefill_then_torch_decode_equals_turbo_alone(
    llama_dir: Path, turbo: TurboBackend
) -> None:
    torch_backend = TorchBackend(llama_dir, DEVICE, torch.float32)
    prompts = random_prompts([7, 21, 40], turbo.vocab_size, seed=15)
    alone = greedy(turbo, prompts, NEW_TOKENS)
    assert greedy(turbo, prompts, NEW_TOKENS, decode=torch_backend) == alone
    assert greedy(torch_backend, prompts, NEW_TOKENS, decode=turbo) == alone


def test_qwen2_biases_and_tied_embeddings_match_transformers(tmp_path: Path) -> None:
    torch.manual_seed(1)
    config = Qwen2Config(
        **{**TINY_SHAPE, "num_key_value_heads": 1},
        tie_word_embeddings=True,
        initializer_range=0.05,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # random biases: transformers initializes them to zero
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    backend = TurboBackend(tmp_path, DEVICE, torch.float32)
    assert backend.model.weights.lm_head is backend.model.weights.embed
    ref = on_device(model)
    prompts = random_prompts([3, 19, 40], backend.vocab_size, seed=16)
    assert_logits_match(
        all_logits(backend, prompts, new_pool(backend)), reference_logits(ref, prompts), 1e-4
    )


def test_mistral_sliding_window_matches_transformers(tmp_path: Path) -> None:
    torch.manual_seed(2)
    config = MistralConfig(
        **TINY_SHAPE,
        sliding_window=7,  # shorter than the prompts and the decode contexts
        initializer_range=0.1,
    )
    MistralForCausalLM(config).save_pretrained(tmp_path)
    backend = TurboBackend(tmp_path, DEVICE, torch.float32)
    assert set(backend.config.windows) == {7}
    ref = on_device(
        AutoModelForCausalLM.from_pretrained(
            tmp_path, local_files_only=True, attn_implementation="eager"
        )
    )
    prompts = random_prompts([5, 11, 30], backend.vocab_size, seed=17)
    assert_logits_match(
        all_logits(backend, prompts, new_pool(backend)), reference_logits(ref, prompts), 1e-4
    )
    for prompt, tokens in zip(prompts, greedy(backend, prompts, NEW_TOKENS, chunk=8), strict=True):
        assert tokens == hf_greedy(ref, prompt, NEW_TOKENS)
