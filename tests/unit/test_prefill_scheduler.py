"""PrefillScheduler: packing, chunking, prefix hits, back-pressure and abort."""

from __future__ import annotations

import pytest

from lmd.engine.block_manager import BlockManager
from lmd.engine.config import EngineConfig
from lmd.engine.prefill_scheduler import PrefillBatch, PrefillScheduler
from lmd.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

BS = 4


def make(
    num_blocks: int = 64, budget: int = 32, *, prefix: bool = False, session_len: int | None = None
) -> PrefillScheduler:
    config = EngineConfig(
        block_size=BS,
        max_prefill_token_num=budget,
        session_len=session_len,
        enable_prefix_caching=prefix,
    )
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
    return PrefillScheduler(config, bm, eos_token_ids=[2])


def prompt(request_id: str, n: int, first: int = 10, max_tokens: int = 8) -> Sequence:
    tokens = [first + i for i in range(n)]
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens))


def run_step(sched: PrefillScheduler, batch: PrefillBatch, token: int = 99) -> list[Sequence]:
    return sched.postprocess(batch, [token] * len(batch.seqs_to_sample))


def test_several_prompts_are_packed_up_to_the_token_budget() -> None:
    sched = make(budget=25)
    for name in ("a", "b", "c"):
        sched.add(prompt(name, 10))
    batch = sched.schedule()
    assert [(c.seq.request_id, c.start, c.end) for c in batch.chunks] == [
        ("a", 0, 10),
        ("b", 0, 10),
        ("c", 0, 5),
    ]
    assert batch.num_tokens == 25
    assert [s.request_id for s in run_step(sched, batch)] == ["a", "b"]
    batch = sched.schedule()
    assert [(c.seq.request_id, c.start, c.end, c.is_last) for c in batch.chunks] == [
        ("c", 5, 10, True)
    ]


def test_chunked_prefill_covers_every_token_exactly_once_in_order() -> None:
    sched = make(budget=7)
    seqs = [prompt("long", 30), prompt("short", 3, first=100), prompt("mid", 12, first=200)]
    for s in seqs:
        sched.add(s)
    seen: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    done: list[str] = []
    while sched.has_work:
        batch = sched.schedule()
        assert 0 < batch.num_tokens <= 7
        for chunk in batch.chunks:
            seen[chunk.seq.request_id].extend(chunk.token_ids)
        done += [s.request_id for s in run_step(sched, batch)]
    for s in seqs:
        assert seen[s.request_id] == s.prompt_token_ids
        assert s.output_token_ids == [99]
        assert s.num_cached_tokens == s.num_prompt_tokens
    assert done == ["long", "short", "mid"]


def test_only_the_last_chunk_is_sampled() -> None:
    sched = make(budget=8)
    s = prompt("a", 20)
    sched.add(s)
    completed: list[list[Sequence]] = []
    while sched.has_work:
        batch = sched.schedule()
        completed.append(run_step(sched, batch, token=42))
    assert [len(c) for c in completed] == [0, 0, 1]
    assert s.output_token_ids == [42]
    assert s.status is SequenceStatus.WAITING  # ready for decode, blocks kept
    assert len(s.block_table) == 5


def test_prefix_cache_hit_reuses_blocks_and_schedules_fewer_tokens() -> None:
    sched = make(prefix=True)
    system = list(range(50, 66))
    first = Sequence("first", [*system, 1, 2, 3])
    sched.add(first)
    cold = sched.schedule()
    assert cold.num_tokens == 19
    run_step(sched, cold)
    second = Sequence("second", [*system, 7, 8])
    sched.add(second)
    batch = sched.schedule()
    assert [(c.start, c.end) for c in batch.chunks] == [(16, 18)]
    assert batch.num_tokens == 2
    assert second.num_prefix_cached_tokens == 16
    assert second.block_table[:4] == first.block_table[:4]


def test_big_prompt_is_not_starved_by_small_ones_behind_it() -> None:
    sched = make(num_blocks=10, budget=100)
    holder = prompt("holder", 16)  # 4 blocks
    sched.add(holder)
    run_step(sched, sched.schedule())
    big = prompt("big", 28)  # 7 blocks: only 6 free
    small = prompt("small", 2)
    sched.add(big)
    sched.add(small)
    assert sched.schedule().is_empty  # back-pressure: small does not jump the queue
    assert sched.num_waiting == 2
    sched.block_manager.free(holder)
    batch = sched.schedule()
    assert [c.seq.request_id for c in batch.chunks] == ["big", "small"]


def test_max_new_seqs_limits_admission() -> None:
    sched = make()
    for name in ("a", "b", "c"):
        sched.add(prompt(name, 4))
    batch = sched.schedule(max_new_seqs=2)
    assert [c.seq.request_id for c in batch.chunks] == ["a", "b"]
    assert sched.num_waiting == 1


def test_front_insertion_puts_a_preempted_sequence_first() -> None:
    sched = make()
    sched.add(prompt("new", 4))
    back = prompt("back", 4)
    back.output_token_ids = [5, 6]  # generated before it was preempted
    back.status = SequenceStatus.PREEMPTED
    sched.add(back, front=True)
    batch = sched.schedule()
    assert [(c.seq.request_id, c.end) for c in batch.chunks] == [("back", 6), ("new", 4)]
    assert batch.chunks[0].token_ids == [10, 11, 12, 13, 5, 6]


def test_first_token_can_finish_the_request() -> None:
    sched = make()
    s = prompt("one", 5, max_tokens=1)
    sched.add(s)
    (done,) = run_step(sched, sched.schedule())
    assert done.finish_reason is FinishReason.LENGTH
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    eos = prompt("eos", 5)
    sched.add(eos)
    (done,) = run_step(sched, sched.schedule(), token=2)
    assert done.finish_reason is FinishReason.STOP and done.block_table == []


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    sched = make(budget=8)
    partial = prompt("partial", 20)
    queued = prompt("queued", 4)
    sched.add(partial)
    run_step(sched, sched.schedule())  # 8 of 20 tokens computed
    sched.add(queued)
    assert sched.abort("queued") is queued
    assert queued.finish_reason is FinishReason.ABORT
    in_flight = sched.schedule()
    assert sched.abort("partial") is partial
    assert run_step(sched, in_flight) == []  # the step that ran for it is ignored
    assert partial.finish_reason is FinishReason.ABORT and partial.output_token_ids == []
    assert sched.abort("partial") is None
    assert not sched.has_work
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_prompts_that_cannot_fit_are_rejected_with_the_limit() -> None:
    sched = make(num_blocks=64, session_len=16)
    with pytest.raises(ValueError, match=r"has 16 tokens; the limit is 15 \(session_len"):
        sched.add(prompt("long", 16))
    tiny_pool = make(num_blocks=2)
    with pytest.raises(ValueError, match="has 9 tokens; the limit is 7"):
        tiny_pool.add(prompt("big", 9))


def test_postprocess_checks_the_sampled_token_count() -> None:
    sched = make()
    sched.add(prompt("a", 4))
    batch = sched.schedule()
    with pytest.raises(ValueError, match="expected 1 sampled tokens for the completed prompts"):
        sched.postprocess(batch, [])
