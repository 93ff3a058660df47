"""One admitted request in the api (api/request.py): its events, its answer, its stream."""

from __future__ import annotations

import asyncio

import orjson

from lmd import protocol
from lmd.api.deltas import Delta, Tally
from lmd.api.openai_responses import SSE_DONE, CompletionFormat, SseFraming, sse
from lmd.api.openai_schema import ApiError
from lmd.api.request import Event, Events, OpenRequest, add_up, first_events, writes
from lmd.stage_times import StageTimes

MODEL = "SmolLM2-135M-Instruct"


def delta(text: str, completion_tokens: int, finish_reason: str | None = None) -> Delta:
    return Delta(text, finish_reason, 5, completion_tokens, None)


def request() -> OpenRequest:
    return OpenRequest("cmpl-1", "completions", "tokenizer-0")


async def test_events_come_out_in_order_and_all_at_once() -> None:
    events = Events()
    events.put(delta("a", 1))
    events.put(delta("b", 2))
    await events.wait()  # something is there: no waiting
    assert [e.text for e in events.take() if isinstance(e, Delta)] == ["a", "b"]
    assert events.take() == [] and len(events) == 0


async def test_a_waiting_reader_wakes_for_an_event_or_a_done_future() -> None:
    events = Events()
    reader = asyncio.ensure_future(events.wait())
    await asyncio.sleep(0)
    assert not reader.done()
    events.put(delta("a", 1))
    await asyncio.wait_for(reader, 1)

    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    events.take()
    events.wake_on(gone)
    reader = asyncio.ensure_future(events.wait())
    await asyncio.sleep(0)
    gone.set_result(None)
    await asyncio.wait_for(reader, 1)
    assert events.take() == []


async def test_first_events_is_empty_when_the_client_went_first() -> None:
    req = request()
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(first_events(req, gone))
    await asyncio.sleep(0)
    gone.set_result(None)
    assert await asyncio.wait_for(waiting, 1) == []

    req = request()
    req.events.put(delta("a", 1))
    assert len(await first_events(req, asyncio.get_running_loop().create_future())) == 1


async def test_add_up_stops_at_the_last_delta_an_error_or_the_client_leaving() -> None:
    loop = asyncio.get_running_loop()
    req = request()
    for e in (delta("Par", 1), delta("is", 2, "stop"), delta("late", 3)):
        req.events.put(e)
    answers = await add_up(req, loop.create_future())
    assert answers is not None and not isinstance(answers, ApiError)
    assert len(answers) == 1
    assert "".join(answers[0].text) == "Paris" and answers[0].completion_tokens == 2

    req = request()
    req.events.put(protocol.RequestError("cmpl-1", "service_unavailable", "gone"))
    err = await add_up(req, loop.create_future())
    assert isinstance(err, ApiError) and err.status == 503

    req = request()
    gone: asyncio.Future[None] = loop.create_future()
    collecting = asyncio.ensure_future(add_up(req, gone))
    req.events.put(delta("Par", 1))
    await asyncio.sleep(0)
    gone.set_result(None)
    assert await asyncio.wait_for(collecting, 1) is None


async def stream(req: OpenRequest, first: list[Event], later: list[list[Event]]) -> list[bytes]:
    """The stream's writes, with `later` batches put while it waits."""
    statuses: list[int] = []
    fmt = CompletionFormat("cmpl-1", 1, MODEL, include_usage=True)
    out = []
    stages = StageTimes()
    for e in first:  # as the inbox puts them
        req.events.put(e)
    gen = writes(req, SseFraming(fmt), req.events.take(), statuses.append, stages)
    batches = iter(later)
    async for write in gen:
        out.append(write)
        for e in next(batches, []):
            req.events.put(e)
    assert stages.count("sse_write") == len(out)  # every write timed
    assert len(statuses) == 1
    return out


async def test_a_stream_writes_every_event_received_at_once_then_its_end() -> None:
    req = request()
    later: list[list[Event]] = [[delta("c", 3), delta("d", 4, "length")]]
    out = await stream(req, [delta("a", 1), delta("b", 2)], later)
    assert len(out) == 2  # one write per batch; the end goes with the last batch
    events = b"".join(out).split(b"\n\n")[:-1]
    texts = [orjson.loads(e[6:])["choices"][0]["text"] for e in events[:4]]
    assert texts == ["a", "b", "c", "d"]
    assert orjson.loads(events[4][6:])["usage"]["completion_tokens"] == 4
    assert events[5] + b"\n\n" == SSE_DONE
    fmt = CompletionFormat("cmpl-1", 1, MODEL, include_usage=True)
    first_chunk = fmt.chunk(delta("a", 1))
    assert first_chunk is not None and out[0].startswith(sse(first_chunk))


async def test_an_error_ends_the_stream_without_usage() -> None:
    req = request()
    error = protocol.RequestError("cmpl-1", "service_unavailable", "the tokenizer stopped")
    out = await stream(req, [delta("a", 1)], [[error, delta("b", 2)]])
    events = b"".join(out).split(b"\n\n")[:-1]
    assert orjson.loads(events[1][6:])["error"]["message"] == "the tokenizer stopped"
    assert events[2:] == [SSE_DONE[:-2]]  # no usage chunk, no text after the error


def choice_delta(index: int, text: str, tokens: int, reason: str | None = None) -> Delta:
    return Delta(text, reason, 5, tokens, None, 0, 0, index)


async def test_n_choices_add_up_once_the_last_one_finished() -> None:
    loop = asyncio.get_running_loop()
    req = OpenRequest("cmpl-1", "completions", "tokenizer-0", tally=Tally(2))
    for e in (
        choice_delta(1, "b", 1, "stop"),  # choice 1 finishes first: not the end
        choice_delta(0, "a", 1),
        choice_delta(0, "a", 2, "length"),
    ):
        req.events.put(e)
    answers = await asyncio.wait_for(add_up(req, loop.create_future()), 1)
    assert isinstance(answers, list)
    assert ["".join(a.text) for a in answers] == ["aa", "b"]
    assert [a.finish_reason for a in answers] == ["length", "stop"]


async def test_a_stream_of_n_choices_ends_after_its_last_and_sums_their_usage() -> None:
    req = OpenRequest("cmpl-1", "completions", "tokenizer-0", tally=Tally(2))
    first: list[Event] = [choice_delta(0, "a", 1, "stop"), choice_delta(1, "b", 1)]
    out = await stream(req, first, [[choice_delta(1, "c", 2, "length")]])
    events = b"".join(out).split(b"\n\n")[:-1]
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks[:3]] == [
        (0, "a"),
        (1, "b"),
        (1, "c"),
    ]
    assert chunks[3]["usage"]["completion_tokens"] == 3 and chunks[3]["usage"]["prompt_tokens"] == 5
    assert events[-1] + b"\n\n" == SSE_DONE
