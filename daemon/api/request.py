"""One admitted generation request in the api, and how its events become an answer.

The api worker registers an `OpenRequest` per request it hands to the tokenizer; its
inbox puts each TextDelta entry or RequestError in the request's `Events`. `add_up`
turns them into one non-streamed answer (an Answer per choice); `writes` into the bytes
of a stream (SSE or JSON lines, by its Framing). Either ends when every choice finished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from lmd import protocol
from lmd.api.deltas import Answer, Delta, Tally
from lmd.api.openai_responses import Framing
from lmd.api.openai_schema import ApiError
from lmd.stage_times import StageTimes

Event = Delta | protocol.RequestError


class Events:
    """A request's events in arrival order: the inbox puts them, one reader takes them.

    Leaner than an asyncio.Queue, since a streamed token passes through here: `put` is an
    append (and wakes the reader once, however many events arrive before it runs), and
    the reader takes everything that is there at once. `wake_on(future)` also wakes the
    reader when that future completes (the client went away), so that one wait covers
    both without a task per request.
    """

    __slots__ = ("_items", "_waiter", "oldest_at")

    def __init__(self) -> None:
        self._items: list[Event] = []
        self._waiter: asyncio.Future[None] | None = None
        self.oldest_at = 0.0  # perf_counter() when the oldest event not taken came

    def __len__(self) -> int:
        return len(self._items)

    def put(self, event: Event) -> None:
        if not self._items:
            self.oldest_at = time.perf_counter()
        self._items.append(event)
        self.wake()

    def wake(self, _: object = None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def wake_on(self, future: asyncio.Future[None]) -> None:
        future.add_done_callback(self.wake)

    def take(self) -> list[Event]:
        """Every event received since the last take, oldest first."""
        items, self._items = self._items, []
        return items

    async def wait(self) -> None:
        """Return once an event is there (at once if one is) or `wake` was called."""
        if self._items:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


@dataclass(slots=True, eq=False)
class OpenRequest:
    """One admitted request, from its TextRequest until it is closed."""

    id: str
    endpoint: str
    tokenizer: str  # the tokenizer worker that holds it
    events: Events = field(default_factory=Events)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None  # its last delta arrived
    ended: bool = False  # last delta or error seen: the tokenizer no longer holds it
    tally: Tally = field(default_factory=Tally)  # its choices' counts, as they arrive

    @property
    def prompt_tokens(self) -> int:
        return self.tally.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.tally.completion_tokens


async def first_events(request: OpenRequest, client_gone: asyncio.Future[None]) -> list[Event]:
    """The request's first events as they come; [] when the client went first."""
    request.events.wake_on(client_gone)
    while True:
        events = request.events.take()
        if events or client_gone.done():
            return events
        await request.events.wait()


async def add_up(
    request: OpenRequest, client_gone: asyncio.Future[None]
) -> list[Answer] | ApiError | None:
    """The whole answer, an Answer per choice; None when the client went before it was
    complete."""
    answers = [Answer() for _ in range(request.tally.n)]
    tally = Tally(request.tally.n)
    request.events.wake_on(client_gone)
    while True:
        for event in request.events.take():
            if isinstance(event, protocol.RequestError):
                return ApiError.from_request_error(event)
            answers[event.index].add(event)
            if tally.add(event):
                return answers
        if client_gone.done():
            return None
        await request.events.wait()


async def writes(
    request: OpenRequest,
    framing: Framing,
    first: list[Event],
    sent: Callable[[int], None],
    stages: StageTimes,
) -> AsyncGenerator[bytes, None]:
    """A stream's writes, from its first events to its end; `sent(status)` once the end
    went out. Every event already received goes out in one write: a client that is behind
    (or a busy api) gets several tokens per write instead of one write each. Each write
    counts for `sse_write`, from its oldest event's arrival until it went out."""
    status = 200
    out = framing.head()
    tally = Tally(request.tally.n)
    events = first
    ended = False
    arrived = request.events.oldest_at
    while True:
        for item in events:
            if isinstance(item, protocol.RequestError):
                err = ApiError.from_request_error(item)
                status = err.status
                out.append(framing.error(err))
                ended = True
                break
            frame = framing.frame(item)
            if frame is not None:
                out.append(frame)
            if tally.add(item):
                ended = True
                break
        if ended:
            break
        if out:
            yield b"".join(out)  # resumed once written
            stages.observe("sse_write", time.perf_counter() - arrived)
            out = []
        await request.events.wait()
        arrived = request.events.oldest_at
        events = request.events.take()
    out += framing.tail(tally, status == 200)
    if out:
        yield b"".join(out)
        stages.observe("sse_write", time.perf_counter() - arrived)
    sent(status)
