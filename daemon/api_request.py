"""One admitted generation request in the api, and how its events become an answer.

The api worker registers an `OpenRequest` per request it hands to the tokenizer; its
inbox puts each TextDelta entry or RequestError on the request's queue. `add_up` turns
the queue into one non-streamed answer; `writes` into the bytes of a stream (SSE or
JSON lines, by its Framing).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from lmd import protocol
from lmd.openai_responses import Answer, Delta, Framing
from lmd.openai_schema import ApiError

Event = Delta | protocol.RequestError


@dataclass(slots=True, eq=False)
class OpenRequest:
    """One admitted request, from its TextRequest until it is closed."""

    id: str
    endpoint: str
    tokenizer: str  # the tokenizer worker that holds it
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None  # its last delta arrived
    ended: bool = False  # last delta or error seen: the tokenizer no longer holds it
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def add_up(request: OpenRequest) -> Answer | ApiError:
    answer = Answer()
    while not answer.done:
        event = await request.events.get()
        if isinstance(event, protocol.RequestError):
            return ApiError.from_request_error(event)
        answer.add(event)
    return answer


async def writes(
    request: OpenRequest, framing: Framing, first: Event, sent: Callable[[int], None]
) -> AsyncGenerator[bytes, None]:
    """A stream's writes, from its first event to its end; `sent(status)` once the end
    went out. Every event already queued goes out in one write: a client that is behind
    (or a busy api) gets several tokens per write instead of one write each."""
    status = 200
    out = framing.head()
    item: Event = first
    last: Delta | None = None
    while True:
        if isinstance(item, protocol.RequestError):
            err = ApiError.from_request_error(item)
            status = err.status
            out.append(framing.error(err))
            break
        last = item
        frame = framing.frame(item)
        if frame is not None:
            out.append(frame)
        if item.finish_reason is not None:
            break
        if request.events.empty():
            if out:
                yield b"".join(out)
                out = []
            item = await request.events.get()
        else:
            item = request.events.get_nowait()
    out += framing.tail(last, status == 200)
    if out:
        yield b"".join(out)
    sent(status)
