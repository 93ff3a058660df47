"""Measure an engine's worst steps on its GPU, then size its KV pool inside its budget.

Life cycle (Engine.build, on CUDA with a memory plan; memory_plan.py):
  1. `cap_allocator(budget)` before the weights load: torch's allocator in this process
     may hold the budget less the CUDA context, so the load, the profile and every step
     after start-up stay inside the plan (past it an allocation fails in this process,
     never in a neighbour's).
  2. `profile(backend, config, role)` once the weights are in: on a scratch KV pool, the
     steps that need the most memory: one prompt of max_prefill_token_num tokens
     (attention's worst case), max_batch_size prompts sharing those tokens (the most
     logits rows) and, for roles that decode, a decode step of max_batch_size sequences;
     each sampled with top-k, top-p and 20 logprobs. It returns the allocator's peak
     above the weights; with CUDA graphs, the memory the largest graph takes (captured
     once on the scratch pool, then dropped).
  3. `kv_bytes(...)`: cache_max_entry_count of the engine's share, and never more than
     the budget leaves after the weights and the measured peak.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from lmd.engine.backend import Backend
from lmd.engine.config import EngineConfig
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.kv_pool import KVPool
from lmd.engine.memory_plan import Budget, GiB, MemoryPlanError
from lmd.engine.sampler import Sampler
from lmd.engine.sequence import MAX_LOGPROBS, SamplingParams, Sequence
from lmd.protocol.roles import Role

log = logging.getLogger(__name__)

# The sampling a profiled row asks for: every sampler path that allocates (warpers,
# a draw, logprobs of the top alternatives).
WORST_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=MAX_LOGPROBS)
# Prompts of a served step's usual length (16 x 512 in a step of 8,192 tokens).
PROFILE_PROMPTS = 16
# The least room for fragmentation kept above the profiled peak (StepMemory).
FRAGMENTATION_MIN_BYTES = 256 << 20


@dataclass(slots=True)
class StepMemory:
    """What the engine's steps need beyond the weights and the KV pool."""

    peak_bytes: int  # the allocator's peak in the worst eager steps, as profiled
    graph_bytes: int = 0  # the CUDA graphs' pool and buffers

    @property
    def activation_bytes(self) -> int:
        """The peak and room for fragmentation: served steps of mixed shapes leave the
        allocator's cache in pieces a clean profile never sees (on an H100, a prefill
        engine whose pool took all the rest failed steps 0.4 GiB short of the profile's
        1.44 GiB peak, with 0.64 GiB cached in pieces; docs/benchmarks.md)."""
        return self.peak_bytes + max(self.peak_bytes // 2, FRAGMENTATION_MIN_BYTES)

    @property
    def reserve_bytes(self) -> int:
        return self.activation_bytes + self.graph_bytes


def cap_allocator(budget: Budget, device: torch.device) -> None:
    """Cap torch's allocator in this process at the budget less the context."""
    fraction = min(1.0, budget.allocator_bytes / budget.total_bytes)
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def forward_retrying(backend: Backend, batch: ForwardBatch, kv: torch.Tensor) -> torch.Tensor:
    """backend.forward, tried once more after torch's cache is given back when an
    allocation fails under the cap: freed memory cached in a large segment that the
    step's first allocations split cannot be released, and a small allocation that then
    needs a segment of its own fails at the cap with GiBs free in that one. A forward
    only writes its own tokens' K/V and its outputs, so running it again is safe. Not in
    a tensor-parallel group: its other ranks are inside the same forward's collectives,
    which a second forward (or the next step's) would meet out of step, so the failure
    is the group's (a RuntimeError: the worker fails its requests and is restarted)."""
    try:
        return backend.forward(batch, kv)
    except torch.OutOfMemoryError as exc:
        if backend.tp.enabled:
            raise RuntimeError(f"out of memory in a tensor-parallel forward: {exc}") from None
        if kv.device.type != "cuda":
            raise
    # Out of the handler: the failed try's tensors are freed, so its segments can go too.
    torch.cuda.empty_cache()
    return backend.forward(batch, kv)


def profile_batches(
    config: EngineConfig, role: Role, block_size: int
) -> tuple[int, list[tuple[ForwardBatch, int]]]:
    """The worst-case steps as (batch, rows to sample), and the scratch blocks they need:
    max_prefill_token_num tokens as one prompt, as PROFILE_PROMPTS prompts and as one
    prompt per batch place (the most logits rows); a decode step of max_batch_size.

    Token ids are 0 (any id is as costly); the steps write into the scratch pool only."""
    tokens = config.max_prefill_token_num
    if config.session_len is not None:
        tokens = min(tokens, config.session_len - 1)
    most = min(config.max_batch_size, tokens)
    counts = sorted({1, min(PROFILE_PROMPTS, most), most})
    num_blocks = max(n * math.ceil((tokens // n + 1) / block_size) for n in counts) + 1
    batches = [(_prompts(tokens, n, block_size), n) for n in counts]
    if role != Role.PREFILL:
        n = config.max_batch_size
        decode_tables = [[i % (num_blocks - 1)] for i in range(n)]
        decode = ForwardBatch.pack([[0]] * n, [0] * n, decode_tables, block_size)
        batches.append((decode, n))
    return num_blocks, batches


def _prompts(tokens: int, n: int, block_size: int) -> ForwardBatch:
    """`tokens` prompt tokens as `n` prompts as even as can be, each in blocks of its own."""
    lens = [tokens // n + (i < tokens % n) for i in range(n)]
    per = math.ceil(max(lens) / block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(n)]
    return ForwardBatch.pack([[0] * k for k in lens], [0] * n, tables, block_size)


def profile(backend: Backend, config: EngineConfig, role: Role) -> StepMemory:
    """Run the worst-case steps on a scratch pool (see the module doc); CUDA only."""
    device = backend.device
    num_blocks, batches = profile_batches(config, role, config.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_reserved(device)
    scratch = KVPool.for_backend(backend, num_blocks, config.block_size).kv  # [N, L, 2, S, Hkv, D]
    with_scratch = torch.cuda.memory_reserved(device)
    run_steps(backend, scratch, batches)
    torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_reserved(device) - with_scratch
    graphs = 0
    if role != Role.PREFILL:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        probe = backend.probe_graphs(scratch, config.max_batch_size)
        graphs = torch.cuda.memory_reserved(device) - before
        del probe
    del scratch
    torch.cuda.empty_cache()
    log.info(
        "memory profile: a peak of %.2f GiB of activations at the worst step, %.2f GiB of "
        "CUDA graphs (scratch pool %.2f GiB, above %.2f GiB held before)",
        activation / 2**30,
        graphs / 2**30,
        (with_scratch - base) / 2**30,
        base / 2**30,
    )
    return StepMemory(max(0, activation), max(0, graphs))


def run_steps(backend: Backend, kv: torch.Tensor, batches: list[tuple[ForwardBatch, int]]) -> None:
    """Forward and sample each batch, as the engine would (also on CPU, for tests)."""
    sampler = Sampler(backend.eos_token_ids)
    for batch, rows in batches:
        logits = backend.forward_eager(batch, kv)
        seqs = [Sequence(f"profile-{i}", [0], WORST_SAMPLING) for i in range(rows)]
        sampler.sample(logits, seqs).tolist()


def kv_bytes(
    budget: Budget,
    cache_max_entry_count: float,
    held_bytes: int,
    steps: StepMemory,
    free_bytes: int,
) -> int:
    """The KV pool's bytes (module doc, 3): `held_bytes` is what the allocator holds now
    (weights and buffers), `free_bytes` the device's free memory now."""
    room = budget.allocator_bytes - held_bytes - steps.reserve_bytes
    if budget.alone:  # LMDeploy's rule: of the memory free after the weights
        wanted = cache_max_entry_count * free_bytes
        room = min(room, free_bytes - steps.reserve_bytes)
    else:
        wanted = cache_max_entry_count * budget.share_bytes
    return max(0, min(int(wanted), room))


def size_in_budget(
    backend: Backend, config: EngineConfig, role: Role, budget: Budget, block_bytes: int
) -> tuple[int, dict[str, Any]]:
    """The pool's block count inside `budget`, and the plan as `lmdctl status` shows it
    for this worker (bytes); raises MemoryPlanError when not one block fits."""
    device = backend.device
    steps = profile(backend, config, role)
    held = torch.cuda.memory_allocated(device)
    free, _total = torch.cuda.mem_get_info(device)
    cmec = config.cache_max_entry_count
    if isinstance(cmec, int):  # a block count: it must fit, as a fraction of 1.0 would
        room = kv_bytes(budget, 1.0, held, steps, free)
        if cmec * block_bytes > room:
            raise MemoryPlanError(
                f"cache_max_entry_count={cmec} blocks need {cmec * block_bytes / GiB:.2f} GiB "
                f"but the plan leaves {room / GiB:.2f} GiB on {budget.device}; lower it"
            )
        num_blocks = cmec
    else:
        num_blocks = kv_bytes(budget, cmec, held, steps, free) // block_bytes
    if num_blocks < 1:
        raise MemoryPlanError(
            f"no KV block fits in {budget.name}'s budget of {budget.budget_bytes / GiB:.2f} GiB "
            f"on {budget.device} ({held / GiB:.2f} GiB of weights, {steps.reserve_bytes / GiB:.2f} "
            "GiB of activations); raise --gpu-memory-utilization or lower --max-batch-size "
            "or --max-prefill-token-num"
        )
    report = {
        **budget.to_dict(),
        "weight_bytes": held,
        "activation_bytes": steps.activation_bytes,
        "activation_peak_bytes": steps.peak_bytes,
        "graph_bytes": steps.graph_bytes,
        "kv_bytes": num_blocks * block_bytes,
        "kv_blocks": num_blocks,
    }
    return num_blocks, report
