"""Kernels launched with programmatic dependent launch (kernels/pdl.py), bit for bit
against plain launches: a chain of batch-1 products, each reading what the one before
wrote, replayed in a CUDA graph (a product that read its input before the kernel before
it had finished would read the previous replay's values); and turbo's decode steps
(graphs, batch 1 and a bucket of 8) with every PDL kernel, logits equal, on a Llama and
on each newer family (Qwen3, Qwen3-MoE and Mixtral's expert kernels, Gemma 3). Hopper
or later; skipped elsewhere and without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("programmatic dependent launch needs sm_90 or later", allow_module_level=True)
pytest.importorskip("triton")

from pathlib import Path

from lmd.engine.turbo import kernels
from lmd.engine.turbo.backend import TurboBackend
from lmd.engine.turbo.kernels import pdl
from tests.gpu.test_turbo_backend_gpu import save_bf16
from tests.gpu.test_turbo_families_gpu import FAMILIES
from tests.models import random_prompts
from tests.unit.test_turbo_model import greedy, new_pool

pytestmark = pytest.mark.gpu
LAYERS, HIDDEN, WIDE = 6, 4096, 6144


Weights = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def chain(
    x: torch.Tensor, residual: torch.Tensor, weights: Weights
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's shape: norm + product (vector_gemv), then the row back (gemv)."""
    for norm_w, w_in, w_out in weights:
        summed = torch.empty_like(residual)
        h = kernels.vector_gemv(x, w_in, norm=kernels.Norm(norm_w, 1e-5, residual, summed))
        x, residual = kernels.gemv(h, w_out), summed
    return x, residual


def test_a_chain_of_pdl_products_in_a_graph_equals_plain_launches() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen, device="cuda")).bfloat16()

    weights = [
        (1 + rand(HIDDEN, scale=0.1), rand(WIDE, HIDDEN, scale=HIDDEN**-0.5),
         rand(HIDDEN, WIDE, scale=WIDE**-0.5))
        for _ in range(LAYERS)
    ]  # fmt: skip
    x, residual = rand(1, HIDDEN), rand(1, HIDDEN)
    want = chain(x, residual, weights)
    try:
        pdl.ENABLED = True
        assert pdl.launch_options(x.device) == {"launch_pdl": True}
        eager = chain(x, residual, weights)
        static_x, static_res = x.clone(), residual.clone()
        chain(static_x, static_res, weights)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x, static_res, weights)
        for step in range(4):  # each replay starts from other inputs
            new_x, new_res = rand(1, HIDDEN), rand(1, HIDDEN)
            static_x.copy_(new_x)
            static_res.copy_(new_res)
            graph.replay()
            pdl.ENABLED = False
            plain = chain(new_x, new_res, weights)
            pdl.ENABLED = True
            assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1]), step
    finally:
        pdl.ENABLED = False
    assert torch.equal(eager[0], want[0]) and torch.equal(eager[1], want[1])


def decode_logits(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    backend = TurboBackend(model_dir, torch.device("cuda"), torch.bfloat16)
    kv = new_pool(backend, 512, 16)
    backend.capture_graphs(kv, max_batch_size=8)
    logits: list[torch.Tensor] = []
    greedy(backend, prompts, 24, kv=kv, logits=logits)
    return logits


def same_logits_with_pdl(model_dir: Path, num_prompts: int) -> None:
    prompts = random_prompts([37, 5, 130, 64, 9][:num_prompts], 1000, seed=5)
    plain = decode_logits(model_dir, prompts)
    try:
        pdl.ENABLED = True
        launched = decode_logits(model_dir, prompts)
    finally:
        pdl.ENABLED = False
    assert len(launched) == len(plain) == 24
    for step, (got, want) in enumerate(zip(launched, plain, strict=True)):
        assert torch.equal(got, want), step


@pytest.mark.parametrize("num_prompts", [1, 5])
def test_decode_steps_with_pdl_give_the_plain_logits(tmp_path: Path, num_prompts: int) -> None:
    shape = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16}
    model_dir = save_bf16(
        tmp_path, vocab_size=4096, num_hidden_layers=4, num_key_value_heads=4, **shape
    )
    same_logits_with_pdl(model_dir, num_prompts)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_decodes_with_pdl_as_without(tmp_path: Path, family: str) -> None:
    model_class, config = FAMILIES[family]
    torch.manual_seed(5)
    model_class(config).to(torch.bfloat16).save_pretrained(tmp_path)  # type: ignore[arg-type]
    same_logits_with_pdl(tmp_path, 5)
