"""A batch-1 decode step's MLP activation made in gate|up's launch (kernels/vector_gemv.py,
TurboModel.fused_activation), bit for bit against the activation's own kernel: turbo's
decode steps (CUDA graphs) of one sequence, logits equal, on a Llama and on each newer
family (Gemma 3's tanh GELU among them). Also o and down through vector_gemv
(TurboModel.vector_plain) against gemv, teacher-forced: logits within bf16's rounding.
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from pathlib import Path

from lmd.engine.turbo.backend import TurboBackend
from tests.gpu.test_turbo_backend_gpu import save_bf16
from tests.gpu.test_turbo_families_gpu import FAMILIES
from tests.models import random_prompts
from tests.unit.test_turbo_model import greedy, new_pool

pytestmark = pytest.mark.gpu
STEPS = 24


def decode_logits(
    model_dir: Path,
    fused: bool,
    switch: str = "fused_activation",
    force: bool = False,
) -> list[torch.Tensor]:
    backend = TurboBackend(model_dir, torch.device("cuda"), torch.bfloat16)
    setattr(backend.model, switch, fused)
    kv = new_pool(backend, 512, 16)
    backend.capture_graphs(kv, max_batch_size=8)
    logits: list[torch.Tensor] = []
    forced = random_prompts([STEPS], 1000, seed=6) if force else None
    prompts = random_prompts([37], 1000, seed=5)
    greedy(backend, prompts, STEPS, kv=kv, logits=logits, force=forced)
    return logits


def model_of(tmp_path: Path, family: str) -> Path:
    """A bf16 model in tmp_path: a 4-layer Llama ("llama"), or one of FAMILIES."""
    if family == "llama":
        shape = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16}
        return save_bf16(
            tmp_path, vocab_size=4096, num_hidden_layers=4, num_key_value_heads=4, **shape
        )
    model_class, config = FAMILIES[family]
    torch.manual_seed(5)
    model_class(config).to(torch.bfloat16).save_pretrained(tmp_path)  # type: ignore[arg-type]
    return tmp_path


def same_logits_fused(model_dir: Path) -> None:
    fused, separate = decode_logits(model_dir, True), decode_logits(model_dir, False)
    assert len(fused) == len(separate) == STEPS - 1  # the first token is the prefill's
    for step, (got, want) in enumerate(zip(fused, separate, strict=True)):
        assert torch.equal(got, want), step


def test_a_llama_decodes_with_the_activation_folded_as_without(tmp_path: Path) -> None:
    same_logits_fused(model_of(tmp_path, "llama"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_decodes_with_the_activation_folded_as_without(
    tmp_path: Path, family: str
) -> None:
    same_logits_fused(model_of(tmp_path, family))


def close_logits(model_dir: Path, switch: str) -> None:
    """Teacher-forced decode logits with `switch` on within bf16's rounding of those with
    it off, and not all equal (the switch reached the model)."""
    on = decode_logits(model_dir, True, switch, force=True)
    off = decode_logits(model_dir, False, switch, force=True)
    assert len(on) == len(off) == STEPS - 1
    for step, (got, want) in enumerate(zip(on, off, strict=True)):
        assert float((got - want).norm() / want.norm()) < 1e-2, step
    assert any(not torch.equal(got, want) for got, want in zip(on, off, strict=True))


def test_o_and_down_through_vector_gemv_give_gemvs_logits(tmp_path: Path) -> None:
    close_logits(model_of(tmp_path, "llama"), "vector_plain")
