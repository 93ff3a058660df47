"""A batch-1 decode step's MLP activation made in gate|up's launch (kernels/vector_gemv.py,
TurboModel.fused_activation), bit for bit against the activation's own kernel: turbo's
decode steps (CUDA graphs) of one sequence, logits equal, on a Llama and on each newer
family (Gemma 3's tanh GELU among them). Also o's weights asked into L2 ahead of it
(TurboModel.l2_prefetch): the same logits as without, at one and at three sequences.
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
    model_dir: Path, switch: str, on: bool, lengths: tuple[int, ...] = (37,)
) -> list[torch.Tensor]:
    backend = TurboBackend(model_dir, torch.device("cuda"), torch.bfloat16)
    setattr(backend.model, switch, on)
    kv = new_pool(backend, 512, 16)
    backend.capture_graphs(kv, max_batch_size=8)
    logits: list[torch.Tensor] = []
    greedy(backend, random_prompts(list(lengths), 1000, seed=5), STEPS, kv=kv, logits=logits)
    return logits


def same_logits_fused(
    model_dir: Path, switch: str = "fused_activation", lengths: tuple[int, ...] = (37,)
) -> None:
    fused = decode_logits(model_dir, switch, True, lengths)
    separate = decode_logits(model_dir, switch, False, lengths)
    assert len(fused) == len(separate) == STEPS - 1  # the first token is the prefill's
    for step, (got, want) in enumerate(zip(fused, separate, strict=True)):
        assert torch.equal(got, want), step


def test_a_llama_decodes_with_the_activation_folded_as_without(tmp_path: Path) -> None:
    shape = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16}
    same_logits_fused(
        save_bf16(tmp_path, vocab_size=4096, num_hidden_layers=4, num_key_value_heads=4, **shape)
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_decodes_with_the_activation_folded_as_without(
    tmp_path: Path, family: str
) -> None:
    model_class, config = FAMILIES[family]
    torch.manual_seed(5)
    model_class(config).to(torch.bfloat16).save_pretrained(tmp_path)  # type: ignore[arg-type]
    same_logits_fused(tmp_path)


@pytest.mark.parametrize("lengths", [(37,), (37, 5, 90)])
def test_o_asked_into_l2_ahead_changes_no_logit(tmp_path: Path, lengths: tuple[int, ...]) -> None:
    shape = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16}
    model_dir = save_bf16(
        tmp_path, vocab_size=4096, num_hidden_layers=4, num_key_value_heads=4, **shape
    )
    same_logits_fused(model_dir, "l2_prefetch", lengths)
