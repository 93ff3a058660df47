"""The torch backend's CUDA-graph decode steps (torch_backend/graphs.py) on a GPU.

A graphed decode step must give the eager step's greedy tokens (float32: the same
tokens; the attention is turbo's Triton kernel instead of SDPA), on a Llama, a Qwen3 (q/k
norms inside transformers' modules) and a Gemma 3 (sliding windows, its own scale);
a mixture of experts runs eagerly and says why. Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.torch_backend import TorchBackend
from tests.gpu.test_turbo_backend_gpu import agreement_along
from tests.gpu.test_turbo_families_gpu import FAMILIES
from tests.models import GPU_LLAMA, random_prompts, save_tiny_llama
from tests.unit.test_turbo_model import greedy, new_pool

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = str(request.param)
    path = tmp_path_factory.mktemp(name)
    if name == "llama":
        return save_tiny_llama(path, **GPU_LLAMA)
    model_class, config = FAMILIES[name]
    torch.manual_seed(6)
    model_class(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_decode_gives_the_eager_tokens(model_dir: Path, dtype: torch.dtype) -> None:
    graphs = TorchBackend(model_dir, CUDA, dtype)
    eager = TorchBackend(model_dir, CUDA, dtype, cuda_graphs=False)
    assert graphs.use_cuda_graphs and not eager.use_cuda_graphs
    prompts = random_prompts([5, 17, 130, 3, 200], graphs.vocab_size, seed=41)  # bucket 8
    kv = new_pool(graphs, 512, 16)
    graphs.capture_graphs(kv, max_batch_size=16)
    assert graphs.graphs is not None and graphs.graphs.max_batch_size == 16
    ours_logits: list[torch.Tensor] = []
    ours = greedy(graphs, prompts, 32, kv=kv, logits=ours_logits)
    if dtype == torch.float32:
        assert ours == greedy(eager, prompts, 32, kv=new_pool(eager, 512, 16))
        return
    # bf16: two attention kernels round differently, so greedy paths may part at a
    # near-tie; along the graphed path, eager's logits must stay close at every step.
    theirs: list[torch.Tensor] = []
    greedy(eager, prompts, 32, kv=new_pool(eager, 512, 16), force=ours, logits=theirs)
    worst, agreement = agreement_along(ours_logits, theirs)
    print(f"\n{model_dir.name} bf16 graph vs eager: {agreement:.3f} agree, worst {worst:.2e}")
    assert worst < 2e-2 and agreement >= 0.95


def test_a_mixture_of_experts_runs_eagerly_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_class, config = FAMILIES["qwen3-moe"]
    model_class(config).save_pretrained(tmp_path)
    # The "lmd" logger's own level: an lmd.pipeline made earlier in the session sets it
    # (to WARNING by default), which the root's level alone would not override.
    with caplog.at_level("INFO", logger="lmd"):
        backend = TorchBackend(tmp_path, CUDA, torch.bfloat16)
    assert not backend.use_cuda_graphs
    assert "experts are chosen with a host sync" in caplog.text
