"""The migration protocol's two halves (migration.receiver and migration.sender) over
the in-process fake transport: exact bytes, validation of every block id, abort and
timeout on either side, no block leaked."""

from __future__ import annotations

import pytest
import torch

from lmd import protocol
from lmd.engine.block_manager import BlockManager
from lmd.engine.kv_pool import KVPool
from lmd.engine.sequence import FinishReason, SamplingParams, Sequence
from lmd.migration.fake import FakeTransport
from lmd.migration.receiver import MigrationError, Receiver, ReservationRefused
from lmd.migration.sender import Outgoing, Sender

BLOCK = 4  # tokens per block
VOCAB = 100  # the decode model's vocabulary


def pool(num_blocks: int, buffer: memoryview | None = None) -> KVPool:
    return KVPool(
        num_blocks, num_layers=2, num_kv_heads=2, head_dim=4, block_size=BLOCK, buffer=buffer
    )


class Side:
    """One engine's pool in a fake-transport region, and its block manager."""

    def __init__(self, transport: FakeTransport, num_blocks: int, *, prefix: bool = False):
        self.region = transport.create_region(num_blocks * pool(1).block_nbytes)
        self.pool = pool(num_blocks, memoryview(self.region))
        self.blocks = BlockManager(num_blocks, BLOCK, enable_prefix_caching=prefix)


def reserve_msg(rid: str, prompt: list[int], prefill: str = "prefill-0") -> protocol.Reserve:
    return protocol.Reserve(rid, prefill, "tokenizer-0", {}, protocol.pack_ids(prompt))


def reserved_msg(receiver_side: Side, seq: Sequence, **overrides: object) -> protocol.Reserved:
    fields: dict[str, object] = {
        "request_id": seq.request_id,
        "decode": "decode-0",
        "transport": "fake",
        "block_nbytes": receiver_side.pool.block_nbytes,
        "num_blocks": receiver_side.pool.num_blocks,
        "num_cached_blocks": seq.num_cached_tokens // BLOCK,
        "rank_descriptors": [],
        "descriptor": receiver_side.region.descriptor(),
        "block_ids": protocol.pack_ids(seq.block_table),
    }
    fields.update(overrides)
    return protocol.Reserved(**fields)  # type: ignore[arg-type]


def make_receiver(side: Side, timeout_s: float = 10.0) -> Receiver:
    return Receiver(
        side.blocks, eos_token_ids=[0], max_seq_len=1000, timeout_s=timeout_s, vocab_size=VOCAB
    )


def prefilled(side: Side, rid: str, prompt: list[int], seed: int) -> Sequence:
    """A prompt 'computed' on the prefill side: random KV in its blocks."""
    seq = Sequence(rid, prompt, SamplingParams())
    side.blocks.allocate(seq)
    gen = torch.Generator().manual_seed(seed)
    for b in seq.block_table:
        side.pool.kv[b] = torch.randn(side.pool.kv[b].shape, generator=gen)
    seq.num_cached_tokens = len(prompt)
    return seq


def test_kv_arrives_byte_exact_and_blocks_come_back() -> None:
    transport = FakeTransport()
    pre, dec = Side(transport, 16), Side(transport, 16)
    receiver = make_receiver(dec)
    sender = Sender(transport, pre.region, pre.pool)
    # Take a few decode blocks first, so ids differ between the sides (no identity map).
    filler = Sequence("filler", list(range(1, 10)))
    dec.blocks.allocate(filler)

    prompt = list(range(1, 11))  # 10 tokens: 3 blocks, the last one partial
    receiver.reserve(reserve_msg("r1", prompt), prefill_pid=7, now=0.0)
    (granted,) = receiver.grant(num_running=0, now=0.0)
    src = prefilled(pre, "r1", prompt, seed=1)
    out = Outgoing("r1", "tokenizer-0", "decode-0", src, {}, 0.0)
    sender.accept(out, reserved_msg(dec, granted.seq))
    sender.submit(out, now=0.0)
    assert out.ticket is not None and out.ticket.poll()
    for s, d in zip(src.block_table, granted.seq.block_table, strict=True):
        assert torch.equal(pre.pool.kv[s], dec.pool.kv[d])
    assert out.ticket.nbytes == 3 * pre.pool.block_nbytes

    seq = receiver.migrated(protocol.Migrated("r1", "prefill-0", 42, None, 0))
    assert seq is not None and seq.output_token_ids == [42]
    assert seq.num_cached_tokens == len(prompt) and not seq.is_finished
    assert len(receiver) == 0
    dec.blocks.free(seq)
    dec.blocks.free(filler)
    pre.blocks.free(src)
    assert dec.blocks.num_free_blocks == dec.blocks.num_total_blocks
    assert pre.blocks.num_free_blocks == pre.blocks.num_total_blocks


def test_consecutive_blocks_go_as_one_range() -> None:
    transport = FakeTransport()
    pre, dec = Side(transport, 16), Side(transport, 16)
    receiver = make_receiver(dec)
    sender = Sender(transport, pre.region, pre.pool)
    prompt = list(range(1, 17))  # 4 full blocks, 0..3 on both sides
    receiver.reserve(reserve_msg("r", prompt), 7, 0.0)
    (granted,) = receiver.grant(0, 0.0)
    out = Outgoing("r", "tokenizer-0", "decode-0", prefilled(pre, "r", prompt, 2), {}, 0.0)
    sender.accept(out, reserved_msg(dec, granted.seq))
    sender.submit(out, 0.0)
    assert transport.submitted[-1] == [(0, 0, 4 * pre.pool.block_nbytes)]


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ({"block_ids": protocol.pack_ids([0, 1])}, "2 block ids for a 3-block prompt"),
        ({"block_ids": protocol.pack_ids([0, 1, 99])}, "block id 99 outside"),
        ({"block_ids": protocol.pack_ids([0, 1, -1])}, "block id -1 outside"),
        ({"block_ids": protocol.pack_ids([2, 1, 2])}, "appears twice"),
        ({"block_nbytes": 8}, "bytes per block"),
        ({"transport": "host"}, "transport 'host'"),
        ({"decode": "decode-9"}, "was sent to decode-0"),
        ({"num_cached_blocks": 4}, "num_cached_blocks 4 out of range"),
        ({"num_blocks": 1000}, "not 1000 blocks"),
        ({"descriptor": b"fake-region:nope"}, "cannot open"),
    ],
)
def test_a_bad_reservation_is_refused_before_any_byte_moves(
    override: dict[str, object], error: str
) -> None:
    transport = FakeTransport()
    pre, dec = Side(transport, 16), Side(transport, 16)
    sender = Sender(transport, pre.region, pre.pool)
    src = prefilled(pre, "r", list(range(1, 11)), 3)
    target = Sequence("r", list(range(1, 11)))
    dec.blocks.allocate(target)
    before = bytes(dec.region)
    out = Outgoing("r", "tokenizer-0", "decode-0", src, {}, 0.0)
    with pytest.raises(MigrationError, match=error):
        sender.accept(out, reserved_msg(dec, target, **override))
    assert not out.reserved and not transport.submitted
    assert bytes(dec.region) == before


def test_decode_refuses_what_it_can_never_hold() -> None:
    dec = Side(FakeTransport(), 4)
    receiver = make_receiver(dec)
    with pytest.raises(ReservationRefused, match="needs 5 KV blocks; the decode pool has 4"):
        receiver.reserve(reserve_msg("big", list(range(1, 18))), 7, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        bad = protocol.Reserve("x", "prefill-0", "t", {"temperature": -1}, protocol.pack_ids([1]))
        receiver.reserve(bad, 7, 0.0)
    assert len(receiver) == 0


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    """A peer's token ids reach the decode model (a preempted prompt is recomputed, the
    first token is decoded next): one past the vocabulary would fail the whole step."""
    dec = Side(FakeTransport(), 8)
    receiver = make_receiver(dec)
    with pytest.raises(ValueError, match=r"prompt token id 100 is outside .* \(0-99\)"):
        receiver.reserve(reserve_msg("a", [1, VOCAB]), 7, 0.0)
    stops = protocol.Reserve(
        "s", "prefill-0", "t", {"stop_token_ids": [7, 1000]}, protocol.pack_ids([1])
    )
    with pytest.raises(ValueError, match="stop_token_ids entry 1000"):
        receiver.reserve(stops, 7, 0.0)
    assert len(receiver) == 0
    receiver.reserve(reserve_msg("b", [1, 2, 3]), 7, 0.0)
    receiver.grant(0, 0.0)
    with pytest.raises(MigrationError, match="token id 100 is outside the vocabulary"):
        receiver.migrated(protocol.Migrated("b", "prefill-0", VOCAB, None, 0))
    assert len(receiver) == 0 and dec.blocks.num_free_blocks == 8
    receiver.reserve(reserve_msg("c", [1, 2, 3]), 7, 0.0)
    receiver.grant(0, 0.0)
    with pytest.raises(MigrationError, match="9 cached tokens of a 3-token prompt"):
        receiver.migrated(protocol.Migrated("c", "prefill-0", 5, None, 9))
    assert len(receiver) == 0 and dec.blocks.num_free_blocks == 8


def test_reservations_of_a_receiver() -> None:
    dec = Side(FakeTransport(), 8)
    receiver = make_receiver(dec)
    receiver.reserve(reserve_msg("a", [1, 2]), 7, 0.0)
    other = protocol.Reserve("b", "prefill-0", "tokenizer-1", {}, protocol.pack_ids([1, 2]))
    receiver.reserve(other, 7, 0.0)
    receiver.reserve(reserve_msg("c", [3, 4]), 7, 0.0)
    receiver.grant(0, 0.0)
    assert receiver.request_ids_of("tokenizer-0") == ["a", "c"]
    receiver.abort("a")  # aborted: its blocks wait for prefill, nothing more to do
    assert receiver.request_ids_of("tokenizer-0") == ["c"]


def test_reservations_wait_for_blocks_in_order() -> None:
    dec = Side(FakeTransport(), 4)
    receiver = make_receiver(dec)
    receiver.reserve(reserve_msg("a", list(range(1, 12))), 7, 0.0)  # 3 blocks
    receiver.reserve(reserve_msg("b", list(range(1, 8))), 7, 0.0)  # 2 blocks
    receiver.reserve(reserve_msg("c", [1]), 7, 0.0)  # 1 block, but behind b
    assert [r.seq.request_id for r in receiver.grant(0, 0.0)] == ["a"]
    assert receiver.grant(0, 0.0) == []  # b waits (back-pressure); c does not overtake it
    receiver.release(protocol.Release("a", "prefill-0"))
    assert [r.seq.request_id for r in receiver.grant(0, 1.0)] == ["b", "c"]


def test_running_sequences_keep_headroom() -> None:
    dec = Side(FakeTransport(), 4)
    receiver = make_receiver(dec)
    receiver.reserve(reserve_msg("a", list(range(1, 8))), 7, 0.0)  # 2 of 4 blocks
    assert receiver.grant(num_running=3, now=0.0) == []  # 2 + 3 running > 4 free
    assert len(receiver.grant(num_running=2, now=0.0)) == 1


def test_abort_of_a_granted_reservation_waits_for_its_prefill() -> None:
    dec = Side(FakeTransport(), 8)
    receiver = make_receiver(dec)
    receiver.reserve(reserve_msg("a", list(range(1, 10))), 7, 0.0)
    receiver.grant(0, 0.0)
    assert receiver.abort("a")
    # A copy may still be writing: the blocks stay held until prefill is done.
    assert dec.blocks.num_free_blocks == 8 - 3
    assert receiver.migrated(protocol.Migrated("a", "prefill-0", 5, None, 0)) is None
    assert dec.blocks.num_free_blocks == 8 and len(receiver) == 0


def test_abort_of_a_queued_reservation_frees_at_once() -> None:
    dec = Side(FakeTransport(), 2)
    receiver = make_receiver(dec)
    receiver.reserve(reserve_msg("a", list(range(1, 8))), 7, 0.0)
    receiver.reserve(reserve_msg("b", [1, 2]), 7, 0.0)
    receiver.grant(0, 0.0)
    assert receiver.abort("b") and receiver.num_queued == 0
    # Prefill's Release of b (it learned of the abort too) is expected: not a stray
    # message. Another one, or one from a prefill that never asked, is.
    with pytest.raises(MigrationError):
        receiver.release(protocol.Release("b", "prefill-1"))
    assert receiver.release(protocol.Release("b", "prefill-0")) is None
    with pytest.raises(MigrationError):
        receiver.release(protocol.Release("b", "prefill-0"))


def test_foreign_and_out_of_order_messages_are_rejected() -> None:
    dec = Side(FakeTransport(), 8)
    receiver = make_receiver(dec)
    with pytest.raises(MigrationError, match="no granted reservation"):
        receiver.migrated(protocol.Migrated("nobody", "prefill-0", 1, None, 0))
    receiver.reserve(reserve_msg("a", [1, 2, 3]), 7, 0.0)
    with pytest.raises(MigrationError, match="no granted reservation"):  # not granted yet
        receiver.migrated(protocol.Migrated("a", "prefill-0", 1, None, 0))
    receiver.grant(0, 0.0)
    with pytest.raises(MigrationError, match="from prefill-1"):  # not its owner
        receiver.migrated(protocol.Migrated("a", "prefill-1", 1, None, 0))
    with pytest.raises(MigrationError, match="from prefill-1"):
        receiver.release(protocol.Release("a", "prefill-1"))
    with pytest.raises(MigrationError, match="already reserved"):
        receiver.reserve(reserve_msg("a", [1]), 7, 0.0)
    assert len(receiver) == 1  # the real reservation is untouched
    receiver.release(protocol.Release("a", "prefill-0"))
    assert dec.blocks.num_free_blocks == 8


def test_a_dead_or_restarted_prefill_loses_its_reservations() -> None:
    dec = Side(FakeTransport(), 8)
    receiver = make_receiver(dec)
    receiver.reserve(reserve_msg("a", [1, 2], "prefill-0"), 100, 0.0)
    receiver.reserve(reserve_msg("b", [1, 2], "prefill-1"), 200, 0.0)
    receiver.reserve(reserve_msg("c", [3, 4], "prefill-1"), None, 0.0)  # pid not known yet
    receiver.grant(0, 0.0)
    gone = receiver.prefill_gone({"prefill-0": 101, "prefill-1": 200})  # prefill-0 restarted
    assert [r.seq.request_id for r in gone] == ["a"]
    gone = receiver.prefill_gone({"prefill-0": 101})  # prefill-1 died
    assert sorted(r.seq.request_id for r in gone) == ["b", "c"]
    assert dec.blocks.num_free_blocks == 8


def test_granted_reservations_expire() -> None:
    dec = Side(FakeTransport(), 8)
    receiver = make_receiver(dec, timeout_s=5.0)
    receiver.reserve(reserve_msg("a", [1, 2]), 7, 0.0)
    receiver.reserve(reserve_msg("b", [1, 2]), 7, 0.0)
    receiver.grant(0, 1.0)
    assert receiver.expire(5.5) == []
    assert [r.seq.request_id for r in receiver.expire(6.5)] == ["a", "b"]
    assert dec.blocks.num_free_blocks == 8


def test_a_first_token_that_finishes_frees_the_blocks() -> None:
    dec = Side(FakeTransport(), 8)
    receiver = make_receiver(dec)  # eos is token 0
    receiver.reserve(reserve_msg("a", [1, 2, 3, 4, 5]), 7, 0.0)
    receiver.grant(0, 0.0)
    seq = receiver.migrated(protocol.Migrated("a", "prefill-0", 0, None, 0))
    assert seq is not None and seq.finish_reason == FinishReason.STOP
    assert dec.blocks.num_free_blocks == 8


def test_decode_prefix_cache_hits_are_not_copied() -> None:
    transport = FakeTransport()
    pre, dec = Side(transport, 16), Side(transport, 16, prefix=True)
    receiver = make_receiver(dec)
    sender = Sender(transport, pre.region, pre.pool)
    history = list(range(1, 10))  # 2 full blocks + 1 token
    old = Sequence("old", history)
    dec.blocks.allocate(old)
    old.num_cached_tokens = len(history)
    dec.blocks.cache_full_blocks(old)
    dec.blocks.free(old)  # evictable, still cached

    prompt = [*history, 10, 11, 12]  # 3 blocks; the first 2 are cached on decode
    receiver.reserve(reserve_msg("r", prompt), 7, 0.0)
    (granted,) = receiver.grant(0, 0.0)
    src = prefilled(pre, "r", prompt, 5)
    out = Outgoing("r", "tokenizer-0", "decode-0", src, {}, 0.0)
    sender.accept(out, reserved_msg(dec, granted.seq))
    assert out.num_cached_blocks == 2
    sender.submit(out, 0.0)
    nbytes = pre.pool.block_nbytes
    assert transport.submitted[-1] == [
        (src.block_table[2] * nbytes, granted.seq.block_table[2] * nbytes, nbytes)
    ]


def test_a_held_copy_can_complete_after_an_abort() -> None:
    transport = FakeTransport(hold=True)
    pre, dec = Side(transport, 8), Side(transport, 8)
    receiver = make_receiver(dec)
    sender = Sender(transport, pre.region, pre.pool)
    prompt = [1, 2, 3, 4, 5]
    receiver.reserve(reserve_msg("r", prompt), 7, 0.0)
    (granted,) = receiver.grant(0, 0.0)
    out = Outgoing("r", "tokenizer-0", "decode-0", prefilled(pre, "r", prompt, 9), {}, 0.0)
    sender.accept(out, reserved_msg(dec, granted.seq))
    sender.submit(out, 0.0)
    assert out.ticket is not None and not out.ticket.poll()
    receiver.abort("r")  # the client left while the copy runs: blocks stay
    assert dec.blocks.num_free_blocks == 8 - 2
    transport.complete_held()
    assert out.ticket.poll()
    receiver.release(protocol.Release("r", "prefill-0"))
    assert dec.blocks.num_free_blocks == 8
