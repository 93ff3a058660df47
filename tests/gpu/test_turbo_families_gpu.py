"""The turbo backend on the newer families in bfloat16 on a GPU: Qwen3, Qwen3-MoE, Mixtral,
Gemma 3.

Per family: logits at every position of 8 prompts (longer than the sliding window where
there is one) against transformers in float32 on the same bf16 weights, CUDA graph
decode equal to eager decode (the experts' routing and sort run inside the graph), and
`auto` choosing turbo; for the MoE families also under --quantization w4a16 (4-bit
experts), CUDA graph decode equal to eager decode at batches that take each of the
native experts kernels' paths. The bf16 bound is the Llama test's (relative error < 2e-2, top-1
agreement >= 99%) or, where transformers' own bf16 run misses it on these random models
(near-tied logits; a flipped expert choice moves a position's output by a whole expert's
share), no worse than transformers' bf16: top-1 within half a point of it, relative error
within 1.5x of it (docs/benchmarks.md has the figures of both). The float32 greedy
equality with transformers and with the torch backend is tests/unit/test_turbo_families.py,
compiled here. Skipped without CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from lmd.engine.backends import select_backend
from lmd.engine.turbo.backend import TurboBackend
from tests.gpu.test_turbo_backend_gpu import PROMPT_LENGTHS, bf16_against_float32
from tests.models import random_prompts
from tests.unit.test_turbo_model import greedy, new_pool

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BF16 = torch.bfloat16
WIDTHS: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}
WINDOW = 96  # shorter than most of PROMPT_LENGTHS

FAMILIES: dict[str, tuple[type[PreTrainedModel], PretrainedConfig]] = {
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(
            **WIDTHS,
            intermediate_size=1408,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=2,
        ),
    ),
    "qwen3-moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **WIDTHS,
            intermediate_size=1408,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=256,
            norm_topk_prob=True,
        ),
    ),
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig(
            **WIDTHS,
            intermediate_size=1408,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(**WIDTHS, intermediate_size=512, num_local_experts=8, sliding_window=WINDOW),
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The family's model with weights that are bf16 values (float32 and bf16 runs use
    the same weights and differ only in arithmetic)."""
    model_class, config = FAMILIES[str(request.param)]
    path = tmp_path_factory.mktemp(str(request.param))
    torch.manual_seed(5)
    model_class(config).to(BF16).save_pretrained(path)  # type: ignore[arg-type]  # decorated .to()
    return path


def test_bf16_logits_agree_with_float32_transformers(family: Path) -> None:
    turbo = TurboBackend(family, CUDA, BF16)
    prompts = random_prompts(PROMPT_LENGTHS, turbo.vocab_size, seed=31)
    rel, top1, hf_rel, hf_top1 = bf16_against_float32(turbo, family, prompts)
    print(f"\n{family.name}: bf16 vs float32 over {sum(PROMPT_LENGTHS)} positions: turbo rel "
          f"{rel:.2e} top-1 {top1:.4f}; transformers bf16 rel {hf_rel:.2e} "
          f"top-1 {hf_top1:.4f}")  # fmt: skip
    assert rel < max(2e-2, 1.5 * hf_rel)
    assert top1 >= min(0.99, hf_top1 - 0.005)


def test_cuda_graph_decode_gives_the_eager_tokens(family: Path) -> None:
    graphs = TurboBackend(family, CUDA, BF16)
    eager = TurboBackend(family, CUDA, BF16, cuda_graphs=False)
    prompts = random_prompts([5, 17, 130, 3, 200], graphs.vocab_size, seed=32)  # bucket 8
    kv = new_pool(graphs, 512, 16)
    graphs.capture_graphs(kv, max_batch_size=16)
    assert graphs.graphs is not None
    assert greedy(graphs, prompts, 32, kv=kv) == greedy(
        eager, prompts, 32, kv=new_pool(eager, 512, 16)
    )


def test_auto_picks_turbo(family: Path) -> None:
    arch = json.loads((family / "config.json").read_text())["architectures"][0]
    assert select_backend("auto", arch, "cuda", family) is TurboBackend


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("batch", [1, 6, 16, 32])
def test_4_bit_experts_decode_in_graphs_as_eager(
    name: str, batch: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--quantization w4a16 (the experts 4-bit too): greedy decode in CUDA graphs gives
    the eager engine's tokens at batches whose experts take one token's path (the router
    that chooses, then the native kernel a block a pair), 8-, 16- and (Hopper) 64-row
    blocks of the native kernels (1.5, 4 and 8 pairs an expert at 6, 16 and 32)."""
    model_class, config = FAMILIES[name]
    path = tmp_path_factory.mktemp(f"{name}-w4")
    torch.manual_seed(6)
    model_class(config).to(BF16).save_pretrained(path)  # type: ignore[arg-type]  # decorated .to()
    graphs = TurboBackend(path, CUDA, BF16, quantization="w4a16")
    eager = TurboBackend(path, CUDA, BF16, quantization="w4a16", cuda_graphs=False)
    assert "experts 16-bit" not in str(graphs.quantization)
    prompts = random_prompts([5, 17, 130, 3, 64, 9, 200, 33] * 4, graphs.vocab_size, seed=33)
    kv = new_pool(graphs, 2048, 16)
    graphs.capture_graphs(kv, max_batch_size=32)
    assert graphs.graphs is not None
    assert greedy(graphs, prompts[:batch], 24, kv=kv) == greedy(
        eager, prompts[:batch], 24, kv=new_pool(eager, 2048, 16)
    )
