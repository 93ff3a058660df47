"""The memory plan on a GPU: an engine built with a budget profiles its worst steps, sizes
its pool inside the budget and never holds more; an allocation that still fails in a step
fails that step's requests and the engine serves on. Skipped without CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmd.engine.config import EngineConfig, read_hf_config
from lmd.engine.engine import Engine
from lmd.engine.memory_needs import engine_needs, weight_bytes
from lmd.engine.memory_plan import Budget, StepOutOfMemory, plan_device
from lmd.engine.sequence import SamplingParams, Sequence
from lmd.protocol.roles import Role
from tests.models import GPU_LLAMA, random_prompts, save_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
SETTINGS = EngineConfig(max_batch_size=64, max_prefill_token_num=2048, block_size=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(
        tmp_path_factory.mktemp("gpu-plan-llama"), max_position_embeddings=4096, **GPU_LLAMA
    )


@pytest.fixture(autouse=True)
def uncapped() -> Iterator[None]:
    """The allocator cap is per process: later tests get the whole device back."""
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def shared_budget(model_dir: Path, utilization: float) -> Budget:
    """decode-0's part of a GPU it shares with a prefill engine."""
    dtype = torch.bfloat16
    config, weights = read_hf_config(model_dir), weight_bytes(model_dir, dtype)
    needs = [
        engine_needs(n, r, config, weights=weights, config=SETTINGS, dtype=dtype)
        for n, r in (("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE))
    ]
    total = torch.cuda.mem_get_info()[1]
    return plan_device("cuda:0", total, needs, utilization)["decode-0"]


def build(model_dir: Path, budget: Budget, backend: str = "turbo") -> Engine:
    return Engine.build(
        model_dir, SETTINGS, device="cuda", backend=backend, role=Role.DECODE, budget=budget
    )


def drive(
    engine: Engine, prompts: list[list[int]], tag: str
) -> tuple[dict[str, int], list[str], list[str]]:
    """Each request's token count, the requests a failed step dropped, and why each failed
    step failed (for an assertion's message)."""
    for i, prompt in enumerate(prompts):
        engine.add(Sequence(f"{tag}{i}", prompt, GREEDY))
    counts: dict[str, int] = {}
    failed: list[str] = []
    reasons: list[str] = []
    while engine.has_work:
        try:
            events = engine.step()
        except StepOutOfMemory as exc:
            failed += exc.request_ids
            reasons.append(exc.detail)
            continue
        for e in events:
            counts[e.request_id] = counts.get(e.request_id, 0) + 1
    return counts, failed, reasons


@pytest.mark.parametrize("backend", ["turbo", "torch"])
def test_an_engine_sized_by_its_budget_never_holds_more(model_dir: Path, backend: str) -> None:
    budget = shared_budget(model_dir, 0.5)
    engine = build(model_dir, budget, backend)
    memory = engine.memory
    assert memory is not None
    assert memory["kv_bytes"] == engine.pool.nbytes
    assert memory["kv_blocks"] == engine.pool.num_blocks
    assert memory["activation_bytes"] > 0
    assert memory["graph_bytes"] > 0  # both backends capture a Llama's decode steps on CUDA
    # its pool is cache_max_entry_count (0.8) of its share, or what the measured peak left
    assert engine.pool.nbytes <= 0.8 * budget.share_bytes + engine.pool.block_nbytes
    torch.cuda.reset_peak_memory_stats()
    prompts = random_prompts([20 + 4 * i for i in range(64)], GPU_LLAMA["vocab_size"], seed=1)
    prompts.append([7] * 2000)  # one prompt of a whole prefill step
    counts, failed, _ = drive(engine, prompts, "r")
    assert failed == [] and all(n == GREEDY.max_tokens for n in counts.values())
    assert torch.cuda.max_memory_reserved() <= budget.allocator_bytes
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_an_allocation_that_fails_in_a_step_costs_its_requests_not_the_engine(
    model_dir: Path,
) -> None:
    budget = shared_budget(model_dir, 0.5)
    engine = build(model_dir, budget)
    prompts = random_prompts([20 + 10 * i for i in range(8)], GPU_LLAMA["vocab_size"], seed=2)
    reference, _, _ = drive(engine, prompts, "ref")
    # Something else in the process takes all the budget leaves: the next steps cannot
    # allocate their activations.
    torch.cuda.empty_cache()
    left = budget.allocator_bytes - torch.cuda.memory_reserved()
    filler = torch.empty(left - (2 << 20), dtype=torch.uint8, device="cuda")
    big = [[9] * 1500 for _ in range(4)]
    _counts, failed, _ = drive(engine, big, "big")
    assert sorted(failed) == [f"big{i}" for i in range(4)]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    del filler
    counts, failed, reasons = drive(engine, prompts, "ref")
    assert failed == [], (reasons, torch.cuda.memory_summary(abbreviated=True))
    assert counts == reference
