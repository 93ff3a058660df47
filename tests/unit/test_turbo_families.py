"""The turbo decoder on the newer families against transformers: Qwen3 (an RMSNorm over
each q and k head), the mixtures of experts of Qwen3-MoE and Mixtral, and Gemma 3 (norms
by 1 + weight around attention and MLP, GELU, scaled embedding, local layers with their
own window and rotary base).

Tiny random-weight models in float32: the same logits at every position of packed
prompts, and the same greedy tokens through chunked prefill and decode steps, with
prompts longer than a sliding window where the family has one. Without CUDA the Triton
kernels run through the interpreter (as tests/unit/test_turbo_model.py); with CUDA the
same checks run compiled, and the torch backend must give the same greedy tokens too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
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

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_model import (
    DEVICE,
    NEW_TOKENS,
    all_logits,
    assert_logits_match,
    greedy,
    new_pool,
    on_device,
    reference_logits,
)

pytest.importorskip("triton")

from lmd.engine.torch_backend import TorchBackend
from lmd.engine.turbo.backend import TurboBackend
from tests.models import TINY_SHAPE, hf_greedy, random_prompts

# Sliding window shorter than the prompts and decode contexts below.
WINDOW = 9


def build(tmp_path: Path, model_class: type[PreTrainedModel], config: PretrainedConfig) -> Path:
    torch.manual_seed(3)
    model = model_class(config)
    with torch.no_grad():  # norms start at 1 (Gemma's at 0): make each one count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(tmp_path)
    return tmp_path


def qwen3(**overrides: Any) -> Qwen3Config:
    return Qwen3Config(**{**TINY_SHAPE, "head_dim": 16, "initializer_range": 0.08, **overrides})


def qwen3_moe(**overrides: Any) -> Qwen3MoeConfig:
    fields = {
        **TINY_SHAPE,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "initializer_range": 0.08,
    }
    return Qwen3MoeConfig(**{**fields, **overrides})


def mixtral(**overrides: Any) -> MixtralConfig:
    fields = {
        **TINY_SHAPE,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
        "initializer_range": 0.08,
    }
    return MixtralConfig(**{**fields, **overrides})


def gemma3(**overrides: Any) -> Gemma3TextConfig:
    fields = {
        **TINY_SHAPE,
        "num_hidden_layers": 3,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,  # not head_dim: its own attention scale
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "initializer_range": 0.08,
        "tie_word_embeddings": True,
    }
    return Gemma3TextConfig(**{**fields, **overrides})


CASES: dict[str, tuple[type[PreTrainedModel], PretrainedConfig]] = {
    "qwen3": (Qwen3ForCausalLM, qwen3()),
    # Layer 1 on windowed (from max_window_layers), layer 0 full.
    "qwen3-window": (
        Qwen3ForCausalLM,
        qwen3(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    # Normalized top-k; layer 1 keeps a dense MLP.
    "qwen3-moe": (Qwen3MoeForCausalLM, qwen3_moe(norm_topk_prob=True, mlp_only_layers=[1])),
    # Raw top-k probabilities, experts in every other layer.
    "qwen3-moe-raw": (Qwen3MoeForCausalLM, qwen3_moe(norm_topk_prob=False, decoder_sparse_step=2)),
    "mixtral-window": (MixtralForCausalLM, mixtral(sliding_window=WINDOW)),
    "gemma3": (Gemma3ForCausalLM, gemma3()),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model_dir(case: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_class, config = CASES[case]
    return build(tmp_path_factory.mktemp(case), model_class, config)


@pytest.fixture(scope="module")
def turbo(model_dir: Path) -> TurboBackend:
    return TurboBackend(model_dir, DEVICE, torch.float32)


@pytest.fixture(scope="module")
def reference(model_dir: Path, case: str) -> PreTrainedModel:
    model_class, _ = CASES[case]
    loaded = model_class.from_pretrained(
        model_dir, local_files_only=True, dtype=torch.float32, attn_implementation="eager"
    )
    return on_device(loaded)


def test_the_config_reads_as_built(case: str, turbo: TurboBackend) -> None:
    c = turbo.config
    assert c.qk_norm == case.startswith(("qwen3", "gemma3"))
    assert c.sandwich_norms == c.norm_plus_one == (case == "gemma3")
    if case == "gemma3":
        assert c.windows == (WINDOW, 0, WINDOW) and c.activation == "gelu_tanh"
        assert c.attn_scale == 24**-0.5 and c.embed_scale == 64**0.5
    if case == "qwen3-window":
        assert c.windows == (0, WINDOW)
    if case == "mixtral-window":
        assert c.windows == (WINDOW, WINDOW)
    if case == "qwen3-moe":
        assert c.moe is not None and c.moe.normalize_top_k
        assert c.moe.sparse_layers == (True, False, True)
    if case == "qwen3-moe-raw":
        assert c.moe is not None and not c.moe.normalize_top_k
        assert c.moe.sparse_layers == (False, True, False)
    if case.startswith("qwen3") and "moe" not in case:
        assert c.moe is None


def test_logits_at_every_position_match_transformers(
    turbo: TurboBackend, reference: PreTrainedModel
) -> None:
    prompts = random_prompts([1, 6, 19, 33, 12], turbo.vocab_size, seed=21)
    ours = all_logits(turbo, prompts, new_pool(turbo))
    assert_logits_match(ours, reference_logits(reference, prompts), 1e-4)


def test_greedy_equals_transformers_generate(
    turbo: TurboBackend, reference: PreTrainedModel
) -> None:
    prompts = random_prompts([5, 14, 27], turbo.vocab_size, seed=22)
    for prompt, tokens in zip(prompts, greedy(turbo, prompts, NEW_TOKENS, chunk=8), strict=True):
        assert tokens == hf_greedy(reference, prompt, NEW_TOKENS)


@pytest.mark.skipif(
    DEVICE.type == "cuda", reason="gemv's tl.dot is TF32 in float32 on CUDA (tests/gpu: bf16)"
)
def test_one_row_steps_through_the_vector_kernels_equal_transformers(
    case: str, model_dir: Path, reference: PreTrainedModel
) -> None:
    """Decode steps of one sequence as CUDA runs them in half precision (fused_batch1:
    kernels/vector_gemv.py, the rotary and K/V write in qkv's launch; a layer of experts
    in kernels/moe_vector.py), here in float32: transformers' greedy tokens, and per-step
    logits of the separate kernels' (moe.py's experts, rotary_and_cache_write). Of the
    dense families Qwen3 (its per-head norms in the fold; ~50 s under the interpreter):
    test_turbo_model.py checks Llama's, test_turbo_gemv.py the fold itself."""
    if not any(name in case for name in ("moe", "mixtral")) and case != "qwen3":
        pytest.skip("a dense family: qwen3 runs the one-row path's dense layers")
    fused = TurboBackend(model_dir, DEVICE, torch.float32, cuda_graphs=False)
    fused.model.skinny = fused.model.fused_batch1 = True
    assert fused.model.vector_experts
    plain = TurboBackend(model_dir, DEVICE, torch.float32, cuda_graphs=False)
    plain.model.vector_experts = plain.model.fused_rotary = False
    plain.model.skinny = plain.model.fused_batch1 = True
    prompt = random_prompts([13], fused.vocab_size, seed=24)[0]  # past the window
    fused_logits: list[torch.Tensor] = []
    plain_logits: list[torch.Tensor] = []
    tokens = greedy(fused, [prompt], 10, logits=fused_logits)[0]
    assert tokens == hf_greedy(reference, prompt, 10), case
    greedy(plain, [prompt], 10, force=[tokens], logits=plain_logits)
    assert_logits_match(fused_logits, plain_logits, 1e-4)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the torch backend's turn needs CUDA time")
def test_greedy_equals_the_torch_backend(model_dir: Path, turbo: TurboBackend) -> None:
    torch_backend = TorchBackend(model_dir, DEVICE, torch.float32)
    prompts = random_prompts([11, 20, 31], turbo.vocab_size, seed=23)
    assert greedy(turbo, prompts, NEW_TOKENS) == greedy(torch_backend, prompts, NEW_TOKENS)
