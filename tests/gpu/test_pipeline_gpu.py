"""lmd.pipeline on CUDA: close() gives the GPU memory back, 64 prompts in one call equal
64 one at a time, get_ppl and logits in float32 against transformers, and turbo's limits.
Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmd.pipeline import GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig, pipeline
from tests.models import GPU_LLAMA, random_prompts, save_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
FP32 = PytorchEngineConfig(device_type="cuda", dtype="float32", cache_max_entry_count=0.2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("gpu-pipeline-llama"), **GPU_LLAMA)


def test_close_gives_the_gpu_memory_back(model_dir: Path) -> None:
    settings = PytorchEngineConfig(device_type="cuda", cache_max_entry_count=0.3)
    gen = GenerationConfig(max_new_tokens=4, output_logits="all")
    allocated = []
    for _ in range(2):  # the first also makes what CUDA keeps per process (cuBLAS workspaces)
        with pipeline(model_dir, backend_config=settings) as pipe:
            pipe([[5, 6, 7]], gen)
            in_use = torch.cuda.memory_allocated()
        allocated.append(torch.cuda.memory_allocated())
        assert in_use > allocated[-1] + 2**30  # the pool was 30% of the free memory
    assert allocated[1] <= allocated[0] + 2**20  # nothing of the first pipeline stayed


def test_64_prompts_in_one_call_equal_64_one_at_a_time(model_dir: Path) -> None:
    prompts = random_prompts([3 + 5 * i for i in range(64)], 2048, seed=11)
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    with pipeline(model_dir, backend_config=FP32) as pipe:
        together = pipe(prompts, gen)
        alone = [pipe(p, gen) for p in prompts]
    assert isinstance(together, list)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]  # type: ignore[union-attr]


def test_ppl_and_logits_equal_transformers_in_float32(model_dir: Path) -> None:
    seqs = random_prompts([2, 50, 700], 2048, seed=12)
    cpu = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = cpu.to(torch.device("cuda"))  # type: ignore[arg-type]  # decorated .to()
    with pipeline(model_dir, backend_config=FP32) as pipe:
        ppl = pipe.get_ppl(seqs)
        r = pipe(seqs[1], GenerationConfig(max_new_tokens=8, output_logits="all"))
    assert not isinstance(r, list) and r.logits is not None
    with torch.inference_mode():
        ids = [torch.tensor([s]).cuda() for s in seqs]
        expected = [float(ref(t, labels=t).loss) for t in ids]
        logits = ref(torch.tensor([seqs[1] + r.token_ids[:-1]]).cuda()).logits[0].float().cpu()
    assert ppl == pytest.approx(expected, abs=1e-4)
    torch.testing.assert_close(r.logits, logits, atol=1e-3, rtol=1e-3)


def test_turbo_returns_logits_but_no_hidden_states(model_dir: Path) -> None:
    pytest.importorskip("triton")
    settings = TurbomindEngineConfig(device_type="cuda", dtype="float32", cache_max_entry_count=0.2)
    with pipeline(model_dir, backend_config=settings) as pipe:
        if pipe.backend.name != "turbo":
            pytest.skip(f"turbo cannot run here: auto chose {pipe.backend.name}")
        r = pipe([5, 6, 7], GenerationConfig(max_new_tokens=4, output_logits="generation"))
        assert not isinstance(r, list) and r.logits is not None and r.logits.shape == (4, 2048)
        assert r.logits.argmax(-1).tolist() == r.token_ids  # greedy, in float32
        with pytest.raises(ValueError, match="output_last_hidden_state needs the torch backend"):
            pipe([5, 6, 7], GenerationConfig(output_last_hidden_state="all"))
        # A decode-shaped scoring pass (one token) must not replace the engine's graphs.
        graphs = pipe.backend.graphs  # type: ignore[attr-defined]
        pipe([5], GenerationConfig(max_new_tokens=1, output_logits="generation"))
        assert pipe.backend.graphs is graphs  # type: ignore[attr-defined]
