"""Rank 0's GroupBackend and a rank's RankRunner, without processes: the ops rank 0 sends
are replayed into a runner over a second copy of the model, which must then hold the
same KV as rank 0's pool (every forward mirrored, in order, on the pool it names); pools
are shown before their first op and dropped with rank 0's; bad ops are refused."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.group_backend import (
    GroupBackend,
    RankRunner,
    decode_batch,
    decode_op,
    encode_batch,
    encode_op,
)
from lmd.engine.kv_pool import KVPool
from lmd.engine.torch_backend import TorchBackend
from tests.models import save_tiny_llama

BLOCK = 16


class Recorder:
    """An OpLink that keeps every op as the wire would carry it."""

    def __init__(self) -> None:
        self.ops: list[list[bytes]] = []

    def send(self, header: dict[str, Any], frames: Sequence[bytes] = ()) -> None:
        self.ops.append(encode_op(header, frames))

    def names(self) -> list[str]:
        return [decode_op(frames)[0]["op"] for frames in self.ops]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def backend(model: Path) -> TorchBackend:
    return TorchBackend(model, torch.device("cpu"), torch.float32)


def test_a_batch_survives_the_wire() -> None:
    batch = ForwardBatch.pack([[3, 4, 5], [6]], [0, 9], [[0], [1, 2]], BLOCK, [True, False])
    header, frames = encode_batch(batch)
    back = decode_batch(header, frames)
    for name in ("input_ids", "positions", "seq_lens", "context_lens", "block_tables"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    assert torch.equal(back.slot_mapping, batch.slot_mapping)
    assert torch.equal(back.logits_indices, batch.logits_indices)
    assert header["ids_on_device"] == 0


def test_ids_left_on_rank_0s_device_get_room_on_the_ranks_device() -> None:
    """A step run ahead has its ids on rank 0's device: they travel by a broadcast, into
    room made on the rank's device (a copy from the host there would wait for every
    step the rank has queued). "meta" stands for a device here."""
    batch = ForwardBatch.pack([[0], [0]], [7, 3], [[0], [1]], BLOCK)
    batch.input_ids = torch.tensor([11, 12], device="meta")
    header, frames = encode_batch(batch)
    assert header["ids_on_device"] == 2
    back = decode_batch(header, frames, torch.device("meta"))
    assert back.input_ids.device.type == "meta"
    assert back.input_ids.shape == (2,) and back.input_ids.dtype == torch.int64
    assert torch.equal(back.positions, batch.positions)


def test_a_rank_replaying_the_ops_holds_rank_0s_kv(model: Path) -> None:
    link = Recorder()
    group = GroupBackend(backend(model), link)
    pool = KVPool.for_backend(group, 8, BLOCK)
    group.adopt_pool(pool.kv)
    prompts = ForwardBatch.pack([list(range(3, 23)), [7, 8, 9]], [0, 0], [[0, 1], [2]], BLOCK)
    decode = ForwardBatch.pack([[5], [6]], [20, 3], [[0, 1], [2]], BLOCK)
    logits = [group.forward(prompts, pool.kv), group.forward_eager(decode, pool.kv)]
    scratch = KVPool.for_backend(group, 2, BLOCK)  # a memory profile's, say
    group.forward(ForwardBatch.pack([[9, 9]], [0], [[0]], BLOCK), scratch.kv)
    del scratch
    gc.collect()
    assert link.names() == ["pool", "forward", "forward_eager", "pool", "forward", "drop"]
    engine_pools: list[KVPool] = []
    runner = RankRunner(backend(model), on_engine_pool=engine_pools.append)
    for frames in link.ops:
        runner.run(*decode_op(frames))
    assert runner.engine_pool is engine_pools[0] and list(runner.pools) == [0]  # scratch gone
    assert torch.equal(runner.engine_pool.kv, pool.kv)
    assert logits[1].shape == (2, group.vocab_size) and group.backend_name == "torch"


def test_ops_a_rank_cannot_run_are_refused(model: Path) -> None:
    runner = RankRunner(backend(model))
    with pytest.raises(ValueError, match="unknown op 'explode'"):
        runner.run({"op": "explode"}, [])
    with pytest.raises(ValueError, match="names a pool this rank does not hold"):
        runner.run({"op": "capture", "pool": 7, "max_batch": 8}, [])
    with pytest.raises(ValueError, match="JSON object with its op"):
        decode_op([b"[1, 2]"])
