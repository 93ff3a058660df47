"""The sender as rank 0 of a tensor-parallel prefill group (migration/sender.py over the
fake transport): it copies its own heads into the decode pool, hands the reservation to
its other ranks as one copy op, and the request's ticket ends only when every rank's
copies did; a reservation sized for another split is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmd import protocol
from lmd.engine.kv_pool import KVPool
from lmd.engine.sequence import SamplingParams, Sequence
from lmd.migration.fake import FakeTransport
from lmd.migration.receiver import MigrationError
from lmd.migration.sender import Outgoing, Sender
from lmd.migration.shards import Shard

BLOCK = 4


def pool(num_blocks: int, heads: int, transport: FakeTransport) -> tuple[Any, KVPool]:
    one = KVPool(1, num_layers=2, num_kv_heads=heads, head_dim=4, block_size=BLOCK)
    region = transport.create_region(num_blocks * one.block_nbytes)
    kv = KVPool(
        num_blocks,
        num_layers=2,
        num_kv_heads=heads,
        head_dim=4,
        block_size=BLOCK,
        buffer=memoryview(region),
    )
    return region, kv


class FakeRanks:
    """Rank 0's other ranks: keeps the copy ops; the test answers for them."""

    def __init__(self) -> None:
        self.ops: list[tuple[dict[str, Any], list[bytes]]] = []
        self.done: dict[int, Callable[[list[dict[str, Any]]], None]] = {}

    def send(self, header: dict[str, Any], frames: list[bytes]) -> None:
        self.ops.append((header, frames))

    def expect_copy(self, op_id: int, done: Callable[[list[dict[str, Any]]], None]) -> None:
        self.done[op_id] = done


def reserved(dec: KVPool, descriptor: bytes, ids: list[int]) -> protocol.Reserved:
    return protocol.Reserved(
        "r", "decode-0", "fake", dec.block_nbytes, dec.num_blocks, 0, [], descriptor,
        protocol.pack_ids(ids),
    )  # fmt: skip


def setup() -> tuple[Sender, FakeRanks, KVPool, KVPool, Outgoing, protocol.Reserved]:
    transport = FakeTransport()
    pre_region, pre = pool(8, 1, transport)  # rank 0 of 2: one of the model's 2 KV heads
    dec_region, dec = pool(8, 2, transport)  # decode in one process: both heads
    ranks = FakeRanks()
    sender = Sender(transport, pre_region, pre, Shard(0, 2), ranks)
    seq = Sequence("r", list(range(1, 8)), SamplingParams())  # 7 tokens: 2 blocks
    seq.block_table = [3, 4]
    for b in seq.block_table:
        pre.kv[b] = torch.randn(pre.kv[b].shape)
    out = Outgoing("r", "tokenizer-0", "decode-0", seq, {}, 0.0)
    return sender, ranks, pre, dec, out, reserved(dec, dec_region.descriptor(), [6, 1])


def test_rank_0_copies_its_heads_and_the_other_ranks_theirs() -> None:
    sender, ranks, pre, dec, out, msg = setup()
    sender.accept(out, msg)
    sender.submit(out, 0.0)
    for s, d in ((3, 6), (4, 1)):  # head 0 is rank 0's, head 1 still untouched
        assert torch.equal(dec.kv[d][..., :1, :], pre.kv[s])
        assert not dec.kv[d][..., 1:, :].any()
    (header, frames), = ranks.ops  # fmt: skip
    assert (header["op"], header["src"], header["dst"]) == ("copy", [3, 4], [6, 1])
    assert header["sizes"] == [len(frames[0])] and header["decode"] == "decode-0"
    assert out.ticket is not None and not out.ticket.poll()  # rank 1 has not answered
    ranks.done[header["id"]]([{"rank": 1, "ok": True, "nbytes": 64, "error": ""}])
    assert out.ticket.poll() and out.ticket.wait(1.0)
    assert out.ticket.nbytes == 2 * pre.block_nbytes + 64


def test_a_rank_whose_copy_failed_fails_the_ticket() -> None:
    sender, ranks, _, _, out, msg = setup()
    sender.accept(out, msg)
    sender.submit(out, 0.0)
    header, _ = ranks.ops[0]
    ranks.done[header["id"]]([{"rank": 1, "ok": False, "nbytes": 0, "error": "pool too small"}])
    assert out.ticket is not None
    with pytest.raises(RuntimeError, match="failed on rank 1: pool too small"):
        out.ticket.wait(1.0)


def test_a_reservation_for_another_split_is_refused() -> None:
    sender, _, _, dec, out, msg = setup()
    wrong = protocol.Reserved(
        "r", "decode-0", "fake", dec.block_nbytes // 2, dec.num_blocks, 0, [], msg.descriptor,
        msg.block_ids,
    )  # fmt: skip
    with pytest.raises(MigrationError, match="per rank of 1"):
        sender.accept(out, wrong)
