"""The engine side of the memory plan: the estimates every engine of a GPU makes alike
(engine/memory_needs.py) and the profile's worst-case steps and pool sizing
(engine/memory_profile.py). The profile's measurement itself runs on a GPU
(tests/gpu/test_memory_plan_gpu.py); here its steps run through the tiny model on CPU."""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import pytest
import torch

from lmd.engine.backend import Backend
from lmd.engine.config import EngineConfig, read_hf_config
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.kv_layout import bytes_per_block
from lmd.engine.memory_needs import (
    engine_needs,
    kv_bytes_per_token,
    reserve_estimate,
    weight_bytes,
)
from lmd.engine.memory_plan import EngineNeeds, plan_device
from lmd.engine.memory_profile import (
    StepMemory,
    forward_retrying,
    kv_bytes,
    profile_batches,
    run_steps,
)
from lmd.engine.parallel import SINGLE, TensorParallel
from lmd.engine.torch_backend import TorchBackend
from lmd.protocol.roles import Role
from tests.models import TINY_SHAPE, load_reference, save_tiny_llama

GiB = 1 << 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_weight_bytes_count_every_tensor_of_the_checkpoint_in_the_dtype_it_loads_as(
    tiny: Path,
) -> None:
    numel = sum(p.numel() for p in load_reference(tiny).parameters())
    # the checkpoint holds lm_head apart from the embedding (untied), as the model does
    assert weight_bytes(tiny, torch.float32) == 4 * numel
    assert weight_bytes(tiny, torch.bfloat16) == 2 * numel


def test_kv_bytes_per_token_is_the_pools_block_bytes_per_token(tiny: Path) -> None:
    config = read_hf_config(tiny)
    s = TINY_SHAPE
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    block = bytes_per_block(
        s["num_hidden_layers"], s["num_key_value_heads"], head_dim, 64, torch.bfloat16
    )
    assert kv_bytes_per_token(config, torch.bfloat16) * 64 == block


def test_the_reserve_grows_with_the_batch_and_the_prefill_step_and_decode_adds_graphs(
    tiny: Path,
) -> None:
    config = read_hf_config(tiny)
    small = EngineConfig(max_batch_size=8, max_prefill_token_num=512)
    big = EngineConfig(max_batch_size=256, max_prefill_token_num=8192)
    dtype = torch.bfloat16
    assert reserve_estimate(config, Role.DECODE, big, dtype) > reserve_estimate(
        config, Role.DECODE, small, dtype
    )
    assert reserve_estimate(config, Role.DECODE, big, dtype) > reserve_estimate(
        config, Role.PREFILL, big, dtype
    )


def test_every_engine_of_a_gpu_computes_the_same_needs(tiny: Path) -> None:
    config = read_hf_config(tiny)
    engine = EngineConfig(max_batch_size=64, max_prefill_token_num=1024, session_len=512)
    weights = weight_bytes(tiny, torch.bfloat16)

    def needs(name: str, role: Role) -> EngineNeeds:
        return engine_needs(
            name, role, config, weights=weights, config=engine, dtype=torch.bfloat16
        )

    prefill, decode = needs("prefill-0", Role.PREFILL), needs("decode-0", Role.DECODE)
    assert prefill == needs("prefill-0", Role.PREFILL)
    # prefill wants KV for 4 steps of prompts (at least one session), decode what it gets
    assert prefill.kv_wanted == 4 * 1024 * kv_bytes_per_token(config, torch.bfloat16)
    assert decode.kv_wanted is None
    plan = plan_device("cuda:0", 80 * GiB, [prefill, decode], 0.9)
    assert plan["prefill-0"].share_bytes == prefill.kv_wanted


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_the_profiles_worst_steps_fit_their_scratch_pool_and_run(tiny: Path, role: Role) -> None:
    config = EngineConfig(
        block_size=16, max_batch_size=12, max_prefill_token_num=200, session_len=1000
    )
    num_blocks, batches = profile_batches(config, role, config.block_size)
    shapes = [(b.num_tokens, b.num_seqs, rows) for b, rows in batches]
    # one long prompt (attention), 12 prompts sharing the 200 tokens (logits rows; 16, the
    # middle case, is more than the batch holds), and for a decode engine a step of 12
    expected = [(200, 1, 1), (200, 12, 12)] + ([(12, 12, 12)] if role == Role.DECODE else [])
    assert shapes == expected
    assert num_blocks >= math.ceil(200 / 16)
    for batch, _rows in batches:
        assert int(batch.block_tables.max()) < num_blocks
    backend = TorchBackend(tiny, torch.device("cpu"), torch.float32)
    kv = torch.zeros(backend.kv_cache_shape(num_blocks, config.block_size))
    run_steps(backend, kv, batches)  # forward and the worst sampling, as on a GPU


def test_the_profile_prefill_never_passes_the_session_length() -> None:
    config = EngineConfig(max_batch_size=4, max_prefill_token_num=8192, session_len=100)
    _blocks, batches = profile_batches(config, Role.HYBRID, 64)
    assert batches[0][0].num_tokens == 99


def test_a_served_size_of_prompts_is_profiled_too() -> None:
    config = EngineConfig(max_batch_size=256, max_prefill_token_num=8192)
    blocks, batches = profile_batches(config, Role.PREFILL, 64)
    assert [(b.num_seqs, b.num_tokens) for b, _ in batches] == [(1, 8192), (16, 8192), (256, 8192)]
    assert blocks == 256 + 1  # 256 prompts of 32 tokens (plus one), a block each


def test_the_reserve_keeps_room_for_fragmentation_above_the_profiled_peak() -> None:
    assert StepMemory(peak_bytes=2 * GiB, graph_bytes=GiB).reserve_bytes == 4 * GiB
    assert StepMemory(peak_bytes=0).activation_bytes == 256 << 20


def test_kv_bytes_take_the_share_or_what_the_budget_leaves_whichever_is_less() -> None:
    engines = [EngineNeeds("prefill-0", Role.PREFILL, 15 * GiB, 2 * GiB, 4 * GiB)]
    engines.append(EngineNeeds("decode-0", Role.DECODE, 15 * GiB, 2 * GiB))
    decode = plan_device("cuda:0", 80 * GiB, engines, 0.9)["decode-0"]
    held = 15 * GiB
    steps = StepMemory(peak_bytes=GiB, graph_bytes=GiB // 2)
    # shared: cache_max_entry_count of its share
    assert kv_bytes(decode, 0.8, held, steps, 60 * GiB) == int(0.8 * decode.share_bytes)
    # the measured peak came out bigger than the estimate: the pool gives way
    greedy = StepMemory(peak_bytes=8 * GiB)
    room = decode.allocator_bytes - held - 12 * GiB  # half the peak again for fragmentation
    assert kv_bytes(decode, 1.0, held, greedy, 60 * GiB) == room
    alone = plan_device("cuda:0", 80 * GiB, [engines[1]], 0.9)["decode-0"]
    # alone on its GPU: of the memory free after the weights (LMDeploy), within the budget
    assert kv_bytes(alone, 0.8, held, steps, 60 * GiB) == int(0.8 * 60 * GiB)
    assert kv_bytes(alone, 1.0, held, steps, 64 * GiB) == alone.allocator_bytes - held - (
        steps.reserve_bytes
    )


class FailingForwards:
    """A backend whose first `failures` forwards fail to allocate."""

    def __init__(self, failures: int, tp: TensorParallel = SINGLE) -> None:
        self.failures, self.calls, self.tp = failures, 0, tp

    def forward(self, batch: ForwardBatch, kv: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls <= self.failures:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return kv


BATCH = ForwardBatch.pack([[1]], [0], [[0]], 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_forward_that_cannot_allocate_runs_once_more_then_fails() -> None:
    kv = torch.zeros(4, device="cuda")
    once = FailingForwards(1)
    assert forward_retrying(cast(Backend, once), BATCH, kv) is kv and once.calls == 2
    always = FailingForwards(3)
    with pytest.raises(torch.OutOfMemoryError):
        forward_retrying(cast(Backend, always), BATCH, kv)
    assert always.calls == 2


def test_a_forward_out_of_memory_is_not_retried_on_a_cpu_pool() -> None:
    backend = FailingForwards(1)
    with pytest.raises(torch.OutOfMemoryError):
        forward_retrying(cast(Backend, backend), BATCH, torch.zeros(4))
    assert backend.calls == 1


def test_a_tensor_parallel_forward_out_of_memory_fails_the_group() -> None:
    """Its other ranks are inside the same forward's collectives: no second forward, and
    not a StepOutOfMemory the engine would serve on after (a RuntimeError: restart)."""
    backend = FailingForwards(1, TensorParallel(rank=0, size=2))
    with pytest.raises(RuntimeError, match="tensor-parallel"):
        forward_retrying(cast(Backend, backend), BATCH, torch.zeros(4))
    assert backend.calls == 1
