"""A request's n choices in the tokenizer (tokenizer/choices.py): their ids and seeds, the
table of choices in flight, and the tokenizer worker fanning a request out over them on
SmolLM2's real tokenizer (its messages recorded instead of sent)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from lmd import protocol
from lmd.config import ServeConfig
from lmd.protocol import Role
from lmd.roles import WorkerSpec
from lmd.tokenizer.choices import Requests, choice_ids, choice_seed, num_uncached
from lmd.tokenizer.request import TokenizerRequest
from lmd.tokenizer.routing import Route
from lmd.tokenizer.text.stream import TextStream
from lmd.tokenizer.worker import TokenizerWorker
from tests.unit.test_tokenizer_request import Decoder, Sent

INT64_MAX = 2**63 - 1


def test_one_choice_keeps_the_request_s_id_and_more_are_numbered() -> None:
    assert choice_ids("cmpl-1", 1) == ["cmpl-1"]
    assert choice_ids("cmpl-1", 3) == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]


def test_choice_i_samples_with_the_seed_plus_i_wrapped_into_int64() -> None:
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(INT64_MAX, 1) == -(2**63)  # wraps, as an int64 addition would
    assert choice_seed(-1, 1) == 0
    assert choice_seed(None, 2) is None  # no seed: every choice random


def test_a_later_choice_computes_the_prompt_past_its_last_full_block() -> None:
    assert num_uncached(200, 64) == 8  # blocks 0-2 cached
    assert num_uncached(128, 64) == 64  # the last token is always computed: its block too
    assert num_uncached(10, 64) == 10  # no full block


def choice(request_id: str, index: int, held: bool = False) -> TokenizerRequest:
    route = Route("hybrid-0", "", None, None)
    out = TokenizerRequest(request_id, "api-0", route, TextStream(Decoder(), prompt_ids=[1]), index)
    if held:
        out.held = protocol.Generate(f"{request_id}-{index}", "tokenizer-0", {}, b"\x01\0\0\0")
    return out


def test_the_table_groups_choices_by_request_and_forgets_a_request_with_its_last() -> None:
    table = Requests()
    a = [choice("a", i, held=i > 0) for i in range(3)]
    table.add("a", [(f"a-{i}", c) for i, c in enumerate(a)])
    table.add("b", [("b", choice("b", 0))])
    assert len(table) == 4 and "a" in table and "a-0" not in table
    assert table.held("a") == a[1:] and table.held("b") == []
    table.finish("a-0")
    assert table.get("a-0") is None and "a" in table and len(table) == 3
    dropped = table.drop("a")
    assert [engine_id for engine_id, _ in dropped] == ["a-1", "a-2"]
    assert "a" not in table and table.drop("a") == [] and len(table) == 1
    table.finish("b")
    assert len(table) == 0 and "b" not in table


# The tokenizer worker fanning out --------------------------------------------------------


@pytest.fixture
async def tokenizer(smollm2_dir: Path, tmp_path: Path) -> AsyncIterator[TokenizerWorker]:
    """A tokenizer worker whose messages land in `SENT[worker]` instead of sockets."""
    config = ServeConfig(runtime_dir=tmp_path, mode="hybrid", model=str(smollm2_dir))
    worker = TokenizerWorker(WorkerSpec("tokenizer-0", Role.TOKENIZER, 0, os.getpid(), {}), config)
    SENT[worker] = Sent()
    worker.push = SENT[worker]  # type: ignore[method-assign, assignment]
    await worker.start()
    yield worker
    worker.tasks.stopping = True  # as Worker.run does before stop()
    await worker.stop()
    del SENT[worker]


SENT: dict[TokenizerWorker, Sent] = {}


def sent(worker: TokenizerWorker, kind: type) -> list[tuple[str, protocol.Message]]:
    """What the worker sent of one kind, in order; taken out of what it sent."""
    every = SENT[worker].messages
    out = [(name, msg) for name, msg in every if isinstance(msg, kind)]
    every[:] = [(name, msg) for name, msg in every if not isinstance(msg, kind)]
    return out


def text_request(n: int, seed: int | None = 5) -> protocol.TextRequest:
    prompt = "word " * 150  # 150+ tokens: two full blocks of 64
    return protocol.TextRequest(
        "cmpl-9", "api-0", None, prompt, {"seed": seed, "max_tokens": 4}, [], True, b"", n=n
    )


def first_token(engine_id: str, cached: int, reason: str | None = None) -> protocol.Tokens:
    ids = protocol.pack_ids([42])
    return protocol.Tokens([engine_id], [reason], [None], [cached], ids, protocol.pack_ids([0]))


async def test_later_choices_go_once_choice_0_s_prompt_is_computed(
    tokenizer: TokenizerWorker,
) -> None:
    await tokenizer.handle(text_request(3))
    (engine, first), *_ = generates = sent(tokenizer, protocol.Generate)
    assert len(generates) == 1 and engine == "hybrid-0"
    assert isinstance(first, protocol.Generate) and first.request_id == "cmpl-9-0"
    assert first.sampling["seed"] == 5 and tokenizer.inflight() == 3  # two held
    await tokenizer.handle(first_token("cmpl-9-0", 0))
    later = [msg for _, msg in sent(tokenizer, protocol.Generate)]
    assert [g.request_id for g in later] == ["cmpl-9-1", "cmpl-9-2"]  # type: ignore[union-attr]
    assert [g.sampling["seed"] for g in later] == [6, 7]  # type: ignore[union-attr]
    assert all(g.prompt == first.prompt for g in later)  # type: ignore[union-attr]
    # their text goes to the api under the api's id, with each choice's index
    await tokenizer.handle(first_token("cmpl-9-2", 128, "length"))
    tokenizer.outbox.flush()
    (_, delta), *_ = sent(tokenizer, protocol.TextDelta)
    assert isinstance(delta, protocol.TextDelta)
    assert delta.request_ids == ["cmpl-9", "cmpl-9"] and delta.indexes == [0, 2]
    assert delta.cached_tokens == [0, 128] and delta.finish_reasons == [None, "length"]
    assert tokenizer.inflight() == 2


async def test_an_abort_ends_every_choice_sent_and_held(tokenizer: TokenizerWorker) -> None:
    await tokenizer.handle(text_request(3))
    assert len(sent(tokenizer, protocol.Generate)) == 1
    await tokenizer.handle(protocol.Abort("cmpl-9"))
    aborts = [msg.request_id for _, msg in sent(tokenizer, protocol.Abort)]  # type: ignore[union-attr]
    assert aborts == ["cmpl-9-0"]  # the held ones never reached an engine
    assert tokenizer.inflight() == 0 and tokenizer.router.load("hybrid-0") == 0
    await tokenizer.handle(first_token("cmpl-9-0", 0))  # late: nothing is sent for it
    assert sent(tokenizer, protocol.Generate) == [] and tokenizer.inflight() == 0


async def test_an_engine_error_for_one_choice_fails_the_request_once(
    tokenizer: TokenizerWorker,
) -> None:
    await tokenizer.handle(text_request(3))
    await tokenizer.handle(first_token("cmpl-9-0", 0))
    sent(tokenizer, protocol.Generate)
    await tokenizer.handle(protocol.RequestError("cmpl-9-1", "internal_error", "it broke"))
    aborts = [msg.request_id for _, msg in sent(tokenizer, protocol.Abort)]  # type: ignore[union-attr]
    assert aborts == ["cmpl-9-0", "cmpl-9-2"]  # not the one whose engine ended it
    errors = [msg for _, msg in sent(tokenizer, protocol.RequestError)]
    assert errors == [protocol.RequestError("cmpl-9", "internal_error", "it broke")]
    assert tokenizer.inflight() == 0 and tokenizer.router.load("hybrid-0") == 0


async def test_without_prefix_caching_every_choice_goes_at_once(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    config = ServeConfig(
        runtime_dir=tmp_path, mode="hybrid", model=str(smollm2_dir), enable_prefix_caching=False
    )
    worker = TokenizerWorker(WorkerSpec("tokenizer-0", Role.TOKENIZER, 0, os.getpid(), {}), config)
    pushed = Sent()
    worker.push = pushed  # type: ignore[method-assign, assignment]
    await worker.start()
    try:
        await worker.handle(text_request(2, seed=None))
        generates = [m for _, m in pushed.messages if isinstance(m, protocol.Generate)]
        assert [g.request_id for g in generates] == ["cmpl-9-0", "cmpl-9-1"]
        assert [g.sampling["seed"] for g in generates] == [None, None]
    finally:
        worker.tasks.stopping = True
        await worker.stop()
