"""The GPU memory plan with fake device sizes (engine/memory_plan.py)."""

from __future__ import annotations

import pytest

from lmd.engine.memory_plan import (
    CONTEXT_BYTES,
    PREFILL_ROOM_CAP,
    EngineNeeds,
    MemoryPlanError,
    describe,
    plan_device,
    remainder_budget,
)
from lmd.protocol.roles import Role

GiB = 1 << 30
H100 = 80 * GiB
WEIGHTS = 15 * GiB  # a Llama-3-8B shape in bf16


def needs(name: str, role: Role, reserve: int = 2 * GiB, wanted: int | None = None) -> EngineNeeds:
    return EngineNeeds(name, role, WEIGHTS, reserve, wanted)


def test_prefill_and_decode_on_one_gpu_share_it_and_decode_gets_the_larger_kv_share() -> None:
    engines = [needs("prefill-0", Role.PREFILL, wanted=4 * GiB), needs("decode-0", Role.DECODE)]
    plan = plan_device("cuda:0", H100, engines, 0.9)
    prefill, decode = plan["prefill-0"], plan["decode-0"]
    assert prefill.budget_bytes + decode.budget_bytes == pytest.approx(0.9 * H100, abs=2)
    assert prefill.share_bytes == 4 * GiB  # what its prompts in flight need
    assert decode.share_bytes > 5 * prefill.share_bytes
    assert decode.budget_bytes == CONTEXT_BYTES + WEIGHTS + 2 * GiB + decode.share_bytes
    assert not prefill.alone and not decode.alone
    # the allocator cap of each is its budget less the CUDA context
    assert decode.allocator_bytes == decode.budget_bytes - CONTEXT_BYTES


def test_prefill_takes_at_most_its_cap_of_the_room_however_much_it_wants() -> None:
    engines = [needs("prefill-0", Role.PREFILL, wanted=500 * GiB), needs("decode-0", Role.DECODE)]
    plan = plan_device("cuda:0", H100, engines, 0.9)
    room = int(0.9 * H100) - 2 * (CONTEXT_BYTES + WEIGHTS + 2 * GiB)
    assert plan["prefill-0"].share_bytes == int(room * PREFILL_ROOM_CAP)
    assert plan["decode-0"].share_bytes == room - int(room * PREFILL_ROOM_CAP)


def test_an_engine_alone_on_its_gpu_takes_all_of_what_it_may_use() -> None:
    plan = plan_device("cuda:0", H100, [needs("hybrid-0", Role.HYBRID)], 0.9)
    hybrid = plan["hybrid-0"]
    assert hybrid.alone
    assert hybrid.budget_bytes == int(0.9 * H100)
    assert hybrid.share_bytes == int(0.9 * H100) - CONTEXT_BYTES - WEIGHTS - 2 * GiB


def test_prefill_and_decode_on_two_gpus_each_have_theirs_to_themselves() -> None:
    prefill = plan_device("cuda:0", H100, [needs("prefill-0", Role.PREFILL, wanted=GiB)], 0.9)
    decode = plan_device("cuda:1", H100, [needs("decode-0", Role.DECODE)], 0.9)
    # alone on its GPU, prefill is not held to what it wants: the whole room is its own
    assert prefill["prefill-0"].budget_bytes == decode["decode-0"].budget_bytes == int(0.9 * H100)
    assert prefill["prefill-0"].alone and decode["decode-0"].device == "cuda:1"


def test_several_decode_workers_on_one_gpu_split_what_prefill_leaves_evenly() -> None:
    engines = [
        needs("prefill-0", Role.PREFILL, wanted=2 * GiB),
        needs("decode-0", Role.DECODE),
        needs("decode-1", Role.DECODE),
        needs("decode-2", Role.DECODE),
    ]
    plan = plan_device("cuda:0", 141 * GiB, engines, 0.9)
    shares = {plan[f"decode-{i}"].share_bytes for i in range(3)}
    assert len(shares) == 1
    assert sum(b.budget_bytes for b in plan.values()) <= int(0.9 * 141 * GiB)
    assert all(b.num_engines == 4 for b in plan.values())


def test_a_model_too_big_for_the_gpu_is_refused_naming_the_numbers() -> None:
    engines = [needs("prefill-0", Role.PREFILL), needs("decode-0", Role.DECODE)]
    big = [EngineNeeds(e.name, e.role, 40 * GiB, e.reserve_bytes) for e in engines]
    with pytest.raises(MemoryPlanError) as info:
        plan_device("cuda:0", H100, big, 0.9)
    message = str(info.value)
    assert "2 engine(s) on cuda:0 need 86.0 GiB" in message
    assert "40.0 GiB of weights each" in message
    assert "0.9 of its 80.0 GiB allows 72.0" in message
    assert "--mode hybrid" in message


def test_utilization_bounds_the_sum_and_must_be_a_fraction() -> None:
    engines = [needs("prefill-0", Role.PREFILL, wanted=GiB), needs("decode-0", Role.DECODE)]
    low = plan_device("cuda:0", H100, engines, 0.6)
    assert sum(b.budget_bytes for b in low.values()) <= int(0.6 * H100)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            plan_device("cuda:0", H100, engines, bad)


def test_an_engine_added_later_gets_what_the_others_leave_or_a_clear_error() -> None:
    extra = needs("decode-1", Role.DECODE)
    budget = remainder_budget("cuda:0", H100, extra, held_bytes=40 * GiB, utilization=0.9)
    assert budget.budget_bytes == int(0.9 * H100) - 40 * GiB
    assert not budget.alone
    with pytest.raises(MemoryPlanError, match=r"hold 70\.0 of the 72\.0 GiB"):
        remainder_budget("cuda:0", H100, extra, held_bytes=70 * GiB, utilization=0.9)


def test_describe_puts_an_engines_part_of_the_plan_on_one_line() -> None:
    budget = plan_device("cuda:0", H100, [needs("hybrid-0", Role.HYBRID)], 0.9)["hybrid-0"]
    report = {
        **budget.to_dict(),
        "weight_bytes": WEIGHTS,
        "activation_bytes": GiB,
        "graph_bytes": GiB // 4,
        "kv_bytes": 40 * GiB,
        "kv_blocks": 5120,
    }
    line = describe(report)
    assert line.startswith("cuda:0: budget 72.00 of 80.00 GiB (1 engine(s) on it)")
    assert "activations 1.00, CUDA graphs 0.25, KV 40.00 GiB in 5120 blocks" in line
