"""DecodeScheduler: persistent batch, preemption + recompute, finishing, abort.

The hybrid driver below runs both schedulers over one block manager with a fake model
(the next token is a function of all previous tokens) and a fake KV pool that records
which token each slot holds, so any block handed to the wrong sequence shows up.
"""

from __future__ import annotations

import pytest

from lmd.engine.block_manager import BlockManager
from lmd.engine.config import EngineConfig
from lmd.engine.decode_scheduler import DecodeBatch, DecodeScheduler
from lmd.engine.prefill_scheduler import PrefillScheduler
from lmd.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

BS = 4
EOS = 2


def next_token(tokens: list[int]) -> int:
    """The fake model: deterministic in the whole history, never eos."""
    return 10 + (sum(t * (i + 1) for i, t in enumerate(tokens)) % 50)


class FakeKV:
    """slots[block][offset] = the token id whose KV was written there."""

    def __init__(self, num_blocks: int) -> None:
        self.slots: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]

    def write(self, seq: Sequence, start: int, end: int) -> None:
        for pos in range(start, end):
            self.slots[seq.block_table[pos // BS]][pos % BS] = seq.token_ids[pos]

    def check(self, seq: Sequence) -> None:
        held = [self.slots[seq.block_table[p // BS]][p % BS] for p in range(seq.num_cached_tokens)]
        assert held == seq.token_ids[: seq.num_cached_tokens], seq.request_id


class Engine:
    """What a hybrid worker's loop does, minus tensors and sockets."""

    def __init__(
        self, num_blocks: int, max_batch_size: int = 8, budget: int = 16, prefix: bool = False
    ) -> None:
        self.config = EngineConfig(
            block_size=BS,
            max_batch_size=max_batch_size,
            max_prefill_token_num=budget,
            enable_prefix_caching=prefix,
        )
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
        self.prefill = PrefillScheduler(self.config, self.bm, [EOS])
        self.decode = DecodeScheduler(self.config, self.bm, [EOS])
        self.kv = FakeKV(num_blocks)
        self.num_preempted = 0
        self.num_prefilled_tokens = 0

    def step(self) -> None:
        free_slots = self.config.max_batch_size - self.decode.num_seqs - self.prefill.num_running
        pre = self.prefill.schedule(max_new_seqs=max(free_slots, 0))
        self.num_prefilled_tokens += pre.num_tokens
        for chunk in pre.chunks:
            self.kv.write(chunk.seq, chunk.start, chunk.end)
        sampled = [next_token(s.token_ids) for s in pre.seqs_to_sample]
        for seq in self.prefill.postprocess(pre, sampled):
            if not seq.is_finished:
                self.decode.add(seq)
        dec = self.decode.schedule()
        self.num_preempted += len(dec.preempted)
        for seq in dec.preempted:
            self.prefill.add(seq, front=True)
        for seq in dec.seqs:
            self.kv.write(seq, seq.num_tokens - 1, seq.num_tokens)
        self.decode.postprocess(dec, [next_token(s.token_ids) for s in dec.seqs])
        for seq in [*self.prefill.running, *self.decode.running, *self.decode.waiting]:
            self.kv.check(seq)

    def run(self, seqs: list[Sequence], max_steps: int = 2000) -> None:
        for seq in seqs:
            self.prefill.add(seq)
        for _ in range(max_steps):
            if not (self.prefill.has_work or self.decode.has_work):
                return
            self.step()
        raise AssertionError("the engine made no progress")


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def requests(n: int, max_tokens: int = 12) -> list[Sequence]:
    return [
        Sequence(f"r{i}", [20 + i] * (3 + 2 * i), SamplingParams(max_tokens=max_tokens))
        for i in range(n)
    ]


def test_hybrid_run_matches_the_reference_and_frees_everything() -> None:
    engine = Engine(num_blocks=64)
    seqs = requests(5)
    engine.run(seqs)
    for seq in seqs:
        assert seq.output_token_ids == reference(seq.prompt_token_ids, 12)
        assert seq.finish_reason is FinishReason.LENGTH
    assert engine.num_preempted == 0
    assert engine.bm.num_free_blocks == engine.bm.num_total_blocks


@pytest.mark.parametrize("prefix", [False, True])
def test_preemption_under_a_tiny_pool_then_recompute_is_consistent(prefix: bool) -> None:
    engine = Engine(num_blocks=12, prefix=prefix)
    seqs = requests(5)  # together they need 31 blocks at the end
    engine.run(seqs)
    assert engine.num_preempted > 0
    for seq in seqs:
        assert seq.output_token_ids == reference(seq.prompt_token_ids, 12)
    assert sum(s.num_preemptions for s in seqs) == engine.num_preempted
    assert engine.bm.num_free_blocks == engine.bm.num_total_blocks


def test_recompute_after_preemption_reuses_cached_blocks() -> None:
    plain, cached = Engine(num_blocks=12), Engine(num_blocks=12, prefix=True)
    plain.run(requests(5))
    cached.run(requests(5))
    assert cached.num_prefilled_tokens < plain.num_prefilled_tokens


def test_running_batch_never_exceeds_max_batch_size() -> None:
    engine = Engine(num_blocks=64, max_batch_size=2)
    seqs = requests(5, max_tokens=4)
    for seq in seqs:
        engine.prefill.add(seq)
    while engine.prefill.has_work or engine.decode.has_work:
        engine.step()
        assert engine.decode.num_running <= 2
    assert all(s.output_token_ids == reference(s.prompt_token_ids, 4) for s in seqs)


def prefilled(bm: BlockManager, request_id: str, n: int, **params: object) -> Sequence:
    """A sequence whose n-token prompt ran and sampled one token (token 7)."""
    seq = Sequence(request_id, list(range(30, 30 + n)), SamplingParams(**params))  # type: ignore[arg-type]
    bm.allocate(seq)
    seq.num_cached_tokens = n
    seq.append_token(7, eos_token_ids=(), max_seq_len=None)
    return seq


def make(num_blocks: int, **config: object) -> DecodeScheduler:
    cfg = EngineConfig(block_size=BS, **config)  # type: ignore[arg-type]
    return DecodeScheduler(cfg, BlockManager(num_blocks, BS), eos_token_ids=[EOS])


def test_the_most_recently_admitted_sequence_is_preempted() -> None:
    sched = make(4)
    old = prefilled(sched.block_manager, "old", 4)  # 5 tokens: 2 blocks once admitted
    new = prefilled(sched.block_manager, "new", 4)
    sched.add(old)
    sched.add(new)
    for token in (8, 9, 10, 11):  # fill both second blocks: 9 tokens each
        batch = sched.schedule()
        assert [s.request_id for s in batch.seqs] == ["old", "new"]
        sched.postprocess(batch, [token, token])
    assert sched.block_manager.num_free_blocks == 0
    old_blocks = list(old.block_table)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["old"]
    assert batch.preempted == [new]
    assert new.status is SequenceStatus.PREEMPTED and new.block_table == []
    assert new.num_cached_tokens == 0 and new.num_preemptions == 1
    assert new.output_token_ids == [7, 8, 9, 10, 11]  # kept: recompute re-prefills them
    assert old.block_table[:2] == old_blocks and len(old.block_table) == 3


def test_a_lone_sequence_that_cannot_grow_preempts_itself() -> None:
    sched = make(2)
    lone = prefilled(sched.block_manager, "lone", 8)  # both blocks, needs a third
    sched.add(lone)
    batch = sched.schedule()
    assert batch.seqs == [] and batch.preempted == [lone]
    assert sched.block_manager.num_free_blocks == 2


def test_with_nothing_running_the_newest_waiting_sequence_makes_room() -> None:
    sched = make(3)
    a, b, c = (prefilled(sched.block_manager, name, 4) for name in "abc")  # 1 block each
    for seq in (a, b, c):
        sched.add(seq)
    batch = sched.schedule()  # a needs a 2nd block and every block is held by waiting seqs
    assert batch.seqs == [a] and batch.preempted == [c]
    assert c.block_table == [] and c.status is SequenceStatus.PREEMPTED
    assert list(sched.waiting) == [b] and len(a.block_table) == 2


def test_waiting_sequences_join_when_a_slot_frees() -> None:
    sched = make(16, max_batch_size=1)
    a = prefilled(sched.block_manager, "a", 3, max_tokens=2)
    b = prefilled(sched.block_manager, "b", 3, max_tokens=2)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a"] and sched.num_waiting == 1
    assert sched.postprocess(batch, [9]) == [a]  # max_tokens=2 reached
    assert [s.request_id for s in sched.schedule().seqs] == ["b"]


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "num_out"),
    [
        ({}, [EOS], FinishReason.STOP, 2),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS], FinishReason.LENGTH, 3),
        ({"stop_token_ids": (11,)}, [5, 11], FinishReason.STOP, 3),
        ({"min_new_tokens": 3}, [EOS, EOS, EOS], FinishReason.STOP, 4),
        ({"max_tokens": 2}, [5], FinishReason.LENGTH, 2),
    ],
)
def test_finish_reasons(
    params: dict[str, object], tokens: list[int], reason: FinishReason, num_out: int
) -> None:
    sched = make(16)
    seq = prefilled(sched.block_manager, "s", 3, **params)
    sched.add(seq)
    finished: list[Sequence] = []
    for token in tokens:
        finished = sched.postprocess(sched.schedule(), [token])
    assert finished == [seq]
    assert seq.finish_reason is reason and seq.num_output_tokens == num_out
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_session_len_caps_prompt_plus_output() -> None:
    sched = make(16, session_len=6)
    seq = prefilled(sched.block_manager, "s", 3, max_tokens=100)
    sched.add(seq)
    sched.postprocess(sched.schedule(), [5])
    assert sched.postprocess(sched.schedule(), [5]) == [seq]
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_tokens == 6


def test_abort_frees_running_and_waiting_requests() -> None:
    sched = make(16, max_batch_size=1)
    running = prefilled(sched.block_manager, "running", 5)
    waiting = prefilled(sched.block_manager, "waiting", 5)
    sched.add(running)
    sched.add(waiting)
    in_flight = sched.schedule()
    assert sched.abort("waiting") is waiting
    assert sched.abort("running") is running
    assert sched.postprocess(in_flight, [5]) == []  # the step that ran is dropped
    assert running.output_token_ids == [7]
    assert running.finish_reason is waiting.finish_reason is FinishReason.ABORT
    assert sched.abort("running") is None
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_add_requires_a_computed_prompt() -> None:
    sched = make(16)
    raw = Sequence("raw", [1, 2, 3])
    with pytest.raises(ValueError, match="has 3 tokens but 0 cached; decode needs all but"):
        sched.add(raw)


def test_postprocess_needs_one_token_per_sequence() -> None:
    sched = make(16)
    sched.add(prefilled(sched.block_manager, "s", 3))
    with pytest.raises(ValueError, match="expected 1 sampled tokens, one per sequence, got 2"):
        sched.postprocess(sched.schedule(), [1, 2])
    assert DecodeBatch().is_empty
