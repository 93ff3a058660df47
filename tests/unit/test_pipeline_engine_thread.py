"""The pipeline's engine thread on a real Engine with the fake backend: tokens go to
their call's sink (each step, held until a request ends, or only each request's last),
aborts free the blocks, calls run between steps, and close fails whatever waits."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.events import TokenEvent
from lmd.engine.sequence import SamplingParams, Sequence
from lmd.pipeline.engine_thread import HOLD_EVENTS, Delivery, EngineThread, Item
from tests.models import save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("engine-thread"))


@pytest.fixture
def thread(model_dir: Path) -> Iterator[EngineThread]:
    config = EngineConfig(block_size=4, max_batch_size=16, cache_max_entry_count=512)
    t = EngineThread(lambda: Engine.build(model_dir, config, backend="fake"))
    yield t
    t.close()


def seqs(name: str, lengths: list[int]) -> list[Sequence]:
    return [
        Sequence(f"{name}-{i}", [5, 6, 7], SamplingParams(temperature=0, max_tokens=n))
        for i, n in enumerate(lengths)
    ]


def drain(items: queue.SimpleQueue[Item], num_tokens: int) -> list[list[TokenEvent]]:
    got: list[list[TokenEvent]] = []
    while sum(map(len, got)) < num_tokens:
        item = items.get(timeout=30)
        assert not isinstance(item, BaseException)
        got.append(item)
    return got


def test_each_step_goes_to_its_call(thread: EngineThread) -> None:
    a: queue.SimpleQueue[Item] = queue.SimpleQueue()
    b: queue.SimpleQueue[Item] = queue.SimpleQueue()
    thread.add(seqs("a", [5, 5]), a.put)
    thread.add(seqs("b", [3]), b.put)
    from_a, from_b = drain(a, 10), drain(b, 3)
    assert {e.request_id for batch in from_a for e in batch} == {"a-0", "a-1"}
    assert [len(batch) for batch in from_b] == [1, 1, 1]  # one list per step
    assert max(len(batch) for batch in from_a) == 2  # both of a's requests in one step


def test_a_held_call_gets_its_tokens_when_a_request_ends(thread: EngineThread) -> None:
    held: queue.SimpleQueue[Item] = queue.SimpleQueue()
    thread.add(seqs("h", [4, 9]), held.put, delivery=Delivery.HELD)
    got = drain(held, 13)
    assert [len(batch) for batch in got] == [8, 5]  # at h-0's end, then at h-1's
    assert [e.position for e in got[1] if e.request_id == "h-1"] == [4, 5, 6, 7, 8]
    assert thread.call(lambda engine: thread._calls).result() == {}  # nothing kept


def test_a_call_delivered_at_its_ends_gets_each_last_token_and_the_ids_stay(
    thread: EngineThread,
) -> None:
    """Delivery.ENDS: one event per request, when it ends; its Sequence holds every id,
    the same as a call given every step's tokens."""
    ends: queue.SimpleQueue[Item] = queue.SimpleQueue()
    steps: queue.SimpleQueue[Item] = queue.SimpleQueue()
    quiet, loud = seqs("e", [4, 9]), seqs("s", [4, 9])
    thread.add(quiet, ends.put, delivery=Delivery.ENDS)
    thread.add(loud, steps.put)
    got = drain(ends, 2)
    assert [[(e.request_id, e.position, e.finish_reason) for e in b] for b in got] == [
        [("e-0", 3, "length")],
        [("e-1", 8, "length")],
    ]
    every = [e.token_id for batch in drain(steps, 13) for e in batch if e.request_id == "s-1"]
    # The fake backend's next token follows from the last one: same prompt, same tokens.
    assert quiet[1].output_token_ids == every
    assert thread.call(lambda engine: thread._calls).result() == {}


def test_a_held_call_is_sent_every_hold_events_tokens(thread: EngineThread) -> None:
    held: queue.SimpleQueue[Item] = queue.SimpleQueue()
    steps = HOLD_EVENTS // 16 + 3
    thread.add(seqs("h", [steps] * 16), held.put, delivery=Delivery.HELD)
    got = drain(held, 16 * steps)
    assert [len(batch) for batch in got] == [HOLD_EVENTS, 16 * steps - HOLD_EVENTS]


def test_abort_frees_the_blocks_and_the_call(thread: EngineThread) -> None:
    held: queue.SimpleQueue[Item] = queue.SimpleQueue()
    thread.add(seqs("x", [10_000, 10_000]), held.put, delivery=Delivery.HELD)
    thread.add(seqs("y", [10_000]), held.put, delivery=Delivery.ENDS)
    thread.abort(["x-0", "x-1", "y-0"])
    stats = thread.call(lambda engine: engine.stats()).result()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["kv"]["free_blocks"] == stats["kv"]["total_blocks"]
    assert thread.call(lambda engine: (thread._calls, thread._num_every_token)).result() == (
        {},
        0,
    )


def test_close_fails_what_waits_and_refuses_more(thread: EngineThread) -> None:
    items: queue.SimpleQueue[Item] = queue.SimpleQueue()
    thread.add(seqs("c", [10_000]), items.put)
    items.get(timeout=30)  # it runs
    thread.close()
    while not isinstance(item := items.get(timeout=30), BaseException):
        pass
    assert isinstance(item, RuntimeError) and "the pipeline was closed" in str(item)
    assert thread.engine is None
    with pytest.raises(RuntimeError, match="the pipeline is closed"):
        thread.call(lambda engine: engine.stats())


def test_an_engine_built_by_the_thread_is_built_on_it(model_dir: Path) -> None:
    """The thread builds the engine itself (its torch work on one thread), and a build
    that fails raises in the constructor."""
    built_on: list[threading.Thread] = []

    def build() -> Engine:
        built_on.append(threading.current_thread())
        return Engine.build(model_dir, EngineConfig(block_size=4, max_batch_size=4), backend="fake")

    t = EngineThread(build)
    try:
        assert t.engine is not None and built_on == [t._thread]
        assert t.call(lambda engine: threading.current_thread()).result(timeout=30) is t._thread
    finally:
        t.close()

    def fails() -> Engine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineThread(fails)
