"""The turbo backend on a GPU in bfloat16: the issue's correctness criteria.

- logits at every position of 8 prompts vs transformers in float32 on the same (bf16)
  weights: relative error < 2e-2, top-1 agreement >= 99% (transformers' own bf16 run is
  printed beside it as the yardstick);
- turbo prefill + torch decode (and the reverse) give turbo's greedy tokens (32);
- CUDA-graph decode gives the eager decode's tokens;
- `auto` picks turbo here.
Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from transformers import AutoModelForCausalLM, PreTrainedModel

from lmd.engine.backends import select_backend
from lmd.engine.torch_backend import TorchBackend
from lmd.engine.turbo.backend import TurboBackend
from tests.models import random_prompts, save_tiny_llama
from tests.unit.test_turbo_model import all_logits, greedy, new_pool, on_device

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BF16 = torch.bfloat16
PROMPT_LENGTHS = [1, 7, 33, 64, 100, 129, 200, 500]  # 8 prompts, 1,034 positions


def save_bf16(path: Path, **fields: Any) -> Path:
    """A random Llama whose weights are bf16 values, so that the float32 reference and
    the bf16 run use the same weights and differ only in arithmetic."""
    save_tiny_llama(path, max_position_embeddings=2048, **fields)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=BF16)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def smollm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M's widths (576 hidden, 9 heads over 3 KV heads, tied), 4 layers."""
    return save_bf16(
        tmp_path_factory.mktemp("turbo-smollm"),
        vocab_size=4096,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )


def reference(model_dir: Path, dtype: torch.dtype) -> PreTrainedModel:
    return on_device(
        AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
    )


def bf16_against_float32(
    turbo: TurboBackend, model_dir: Path, prompts: list[list[int]]
) -> tuple[float, float, float, float]:
    """turbo's bf16 logits at every position of `prompts`, and transformers' own bf16
    ones, against transformers in float32 on the same weights: (turbo's relative error,
    its top-1 agreement, transformers' bf16 relative error, its top-1 agreement)."""
    ours = torch.cat(all_logits(turbo, prompts, new_pool(turbo, 512, 16)))
    return against_float32(ours, model_dir, prompts)


def against_float32(
    ours: torch.Tensor, model_dir: Path, prompts: list[list[int]]
) -> tuple[float, float, float, float]:
    """bf16_against_float32 for logits computed elsewhere (`ours`: every position of
    `prompts`, concatenated)."""
    ours = ours.to(CUDA)
    refs = {}
    for dtype in (torch.float32, BF16):
        model = reference(model_dir, dtype)
        with torch.inference_mode():
            refs[dtype] = torch.cat(
                [model(torch.tensor([p], device=CUDA)).logits[0].float() for p in prompts]
            )
        del model
    ref = refs[torch.float32]

    def measure(logits: torch.Tensor) -> tuple[float, float]:
        rel = float((logits - ref).norm() / ref.norm())
        return rel, float(logits.argmax(-1).eq(ref.argmax(-1)).float().mean())

    return (*measure(ours), *measure(refs[BF16]))


def test_bf16_logits_agree_with_float32_transformers(smollm_dir: Path) -> None:
    turbo = TurboBackend(smollm_dir, CUDA, BF16)
    prompts = random_prompts(PROMPT_LENGTHS, turbo.vocab_size, seed=21)
    rel, top1, hf_rel, hf_top1 = bf16_against_float32(turbo, smollm_dir, prompts)
    print(  # the figures go to docs/benchmarks.md
        f"\nbf16 vs float32 over {sum(PROMPT_LENGTHS)} positions: turbo rel {rel:.2e} "
        f"top-1 {top1:.4f}; transformers bf16 rel {hf_rel:.2e} top-1 {hf_top1:.4f}"
    )
    assert rel < 2e-2
    assert top1 >= 0.99


def agreement_along(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> tuple[float, float]:
    """Two decoders' teacher-forced decode logits, step by step ([B, V] each): the largest
    relative error of a step (a wrong KV layout or rotation gives ~1), and the share of
    rows where their greedy choices agree."""
    worst = 0.0
    agree = total = 0
    for a, b in zip(ours, theirs, strict=True):
        worst = max(worst, float((a - b).norm() / a.norm()))
        agree += int(a.argmax(-1).eq(b.argmax(-1)).sum())
        total += a.shape[0]
    return worst, agree / total


def test_prefill_and_decode_on_different_backends(tmp_path: Path) -> None:
    """float32: the same 32 greedy tokens whichever backend prefills and which decodes
    (the pool's layout, rotation and dtype are shared). bf16: turbo prefill + torch decode
    gives turbo's 32 tokens on these prompts too. torch and turbo round differently
    (transformers rounds cos/sin to bf16, we rotate in float32), so on other prompts
    greedy paths of a random model can part at near-ties, as transformers' own bf16 paths
    (SDPA and eager attention) part from each other (docs/benchmarks.md: 5 of 8 prompts
    equal). Along turbo's own output, torch decoding from turbo's prefill must give
    turbo's logits within 2e-2 (the issue's bound against float32) at every step and
    choose turbo's token almost everywhere."""
    model_dir = save_bf16(tmp_path, vocab_size=2048, initializer_range=0.05)
    prompts = random_prompts([7, 40, 100], 2048, seed=22)
    turbo = TurboBackend(model_dir, CUDA, torch.float32)
    torch_backend = TorchBackend(model_dir, CUDA, torch.float32)
    alone = greedy(turbo, prompts, 32)
    assert greedy(turbo, prompts, 32, decode=torch_backend) == alone
    assert greedy(torch_backend, prompts, 32, decode=turbo) == alone

    turbo = TurboBackend(model_dir, CUDA, BF16)
    torch_backend = TorchBackend(model_dir, CUDA, BF16)
    ours: list[torch.Tensor] = []
    theirs: list[torch.Tensor] = []
    alone = greedy(turbo, prompts, 32, logits=ours)
    greedy(turbo, prompts, 32, decode=torch_backend, force=alone, logits=theirs)
    worst, agreement = agreement_along(ours, theirs)
    print(
        f"\nbf16 turbo prefill + torch decode, teacher-forced: {agreement:.3f} of turbo's "
        f"tokens, logits within {worst:.2e} of turbo's at every step"
    )
    assert worst < 2e-2 and agreement >= 0.95
    assert greedy(turbo, prompts, 32, decode=torch_backend) == alone


def test_cuda_graph_decode_gives_the_eager_tokens(smollm_dir: Path) -> None:
    graphs = TurboBackend(smollm_dir, CUDA, BF16)
    eager = TurboBackend(smollm_dir, CUDA, BF16, cuda_graphs=False)
    prompts = random_prompts([5, 17, 60, 3, 130], graphs.vocab_size, seed=23)  # bucket 8
    kv = new_pool(graphs, 512, 16)
    graphs.capture_graphs(kv, max_batch_size=16)
    assert graphs.graphs is not None and graphs.graphs.max_batch_size == 16
    with_graphs = greedy(graphs, prompts, 32, kv=kv)
    assert with_graphs == greedy(eager, prompts, 32)


def test_auto_picks_turbo_for_llama_on_cuda(smollm_dir: Path) -> None:
    assert select_backend("auto", "LlamaForCausalLM", "cuda", smollm_dir) is TurboBackend
