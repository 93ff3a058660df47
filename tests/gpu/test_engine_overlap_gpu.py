"""Overlapped decode steps on a GPU (engine.py): turbo with CUDA graphs, tokens fed to
step N+1 on the device while step N's come back. The same events as without overlap.
Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.sequence import SamplingParams
from tests.gpu.test_turbo_backend_gpu import save_bf16
from tests.models import random_prompts
from tests.unit.test_engine_overlap import run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["turbo", "torch"])
def test_overlapped_steps_give_the_same_events(tmp_path: Path, backend: str) -> None:
    model_dir = save_bf16(tmp_path, vocab_size=4096)
    prompts = random_prompts([5, 17, 60, 3, 130, 64], 4096, seed=31)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def engine(overlap: bool | None) -> Engine:
        config = EngineConfig(block_size=16, cache_max_entry_count=512, overlap_steps=overlap)
        # torch in float32: cuBLAS may pick another kernel when a finished sequence's row
        # runs ahead (6 rows instead of 5), and bf16 rounding would then part near-ties.
        # turbo's graph for 5 and 6 rows is the same (bucket 8).
        dtype = "float32" if backend == "torch" else "bfloat16"
        return Engine.build(model_dir, config, device="cuda", dtype=dtype, backend=backend)

    probe = run(engine(False), [(prompts[0], greedy)])["r0"]
    stop_id = probe[7][0]
    requests = [
        (prompts[0], SamplingParams(temperature=0.0, stop_token_ids=(stop_id,), max_tokens=40)),
        (prompts[1], greedy),
        (prompts[2], SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=33)),
        (prompts[3], SamplingParams(temperature=1.0, seed=9, logprobs=3, max_tokens=20)),
        (prompts[4], greedy),
        (prompts[5], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
    ]
    plain = run(engine(False), requests, join_at={4: 6})
    overlapped = engine(None)  # the default on CUDA
    assert overlapped.overlap
    assert run(overlapped, requests, join_at={4: 6}) == plain
    assert overlapped.num_ahead_steps > 20


def test_mixed_steps_give_the_tokens_of_separate_steps_on_turbo(tmp_path: Path) -> None:
    """Prompts joining while others decode run in the decode steps' forward (turbo's
    prefill path, out of the graphs); in float32 the greedy tokens are those of separate
    prefill and decode steps (graphed)."""
    model_dir = save_bf16(tmp_path, vocab_size=4096)
    prompts = random_prompts([5, 17, 60, 3, 130, 64], 4096, seed=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = [(prompt, greedy) for prompt in prompts]
    join_at = {i: 4 * i for i in range(len(prompts))}

    def engine(mixed: bool) -> Engine:
        config = EngineConfig(
            block_size=16,
            cache_max_entry_count=512,
            max_prefill_token_num=48,
            mixed_prefill_tokens=16 if mixed else 0,
        )
        return Engine.build(model_dir, config, device="cuda", dtype="float32", backend="turbo")

    mixed = engine(True)
    assert run(mixed, requests, join_at=join_at) == run(engine(False), requests, join_at=join_at)
    assert mixed.num_mixed_steps > 5
