"""What the tokenizer keeps of one request in flight (of each of its choices, when it asks
for n > 1: choices.py), and the TextDeltas it sends the api."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmd import protocol
from lmd.stage_times import StageTimes
from lmd.tokenizer.routing import Route
from lmd.tokenizer.sessions import Session, Turn
from lmd.tokenizer.text.in_order import InOrder
from lmd.tokenizer.text.stream import StreamUpdate, TextStream

# One output token as an engine sent it: (token id, finish reason, logprobs, cached tokens).
Entry = tuple[int, str | None, dict[str, Any] | None, int]

# One request's entry of a TextDelta, as it was when its text was made: (request id,
# text, finish reason, prompt tokens, completion tokens, logprobs, cached tokens,
# history tokens, choice index).
DeltaEntry = tuple[str, str, str | None, int, int, list[dict[str, Any]] | None, int, int, int]


@dataclass(slots=True)
class TokenizerRequest:
    """One choice of a request: the engine request that samples it (the whole request
    when it asks for one choice)."""

    request_id: str  # the api's id (the engine's is `<id>-<index>` when n > 1)
    reply_to: str  # api worker
    route: Route
    stream: TextStream
    index: int = 0  # the choice's index among the request's n
    # Its Generate, while it waits for choice 0's prompt to be cached (choices.py)
    held: protocol.Generate | None = None
    cached_tokens: int | None = None  # from the engine's first Tokens for it
    reply_pid: int | None = None  # the api process that asked, where known
    # Tokens by position: prefill sends token 0, decode the rest, over different sockets.
    order: InOrder[Entry] = field(default_factory=InOrder)
    # Interactive sessions only: the session, this turn, and what it generated so far.
    session: Session | None = None
    turn: Turn | None = None
    keep_turn: bool = False  # interactive_mode: the answer joins the history
    answer: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)

    @property
    def num_history_tokens(self) -> int:
        return 0 if self.turn is None else self.turn.num_history_tokens

    def delta_entry(self, update: StreamUpdate) -> DeltaEntry:
        """This choice's TextDelta entry for `update`, with its counts as of now."""
        return (
            self.request_id,
            update.text,
            update.finish_reason,
            self.stream.num_prompt_tokens,
            self.stream.num_completion_tokens,
            update.logprobs,
            self.cached_tokens or 0,
            self.num_history_tokens,
            self.index,
        )


def text_delta(entries: list[DeltaEntry]) -> protocol.TextDelta:
    """One TextDelta for one api worker: each entry's new text, in order."""
    rids, texts, reasons, prompts, completions, logprobs, cached, history, indexes = (
        list(column) for column in zip(*entries, strict=True)
    )
    return protocol.TextDelta(
        rids, texts, reasons, prompts, completions, logprobs, cached, history, indexes, time.time()
    )


class DeltaOutbox:
    """The TextDelta entries the tokenizer owes its api workers, sent once per turn of the
    event loop.

    The worker's inbox loop handles every message already received before it yields to
    the loop, so the text of all the Tokens messages handled in one turn goes out as one
    TextDelta per api worker. When the tokenizer is behind (the engine stepped twice while
    it waited for a core) that is one send, one wakeup of the api and one write per stream
    instead of several; when it is not, the entries go out as soon as the message that
    made them is handled, as before. Whatever else goes to an api worker goes through
    `send`, which flushes first, so that it arrives after the text before it. From the
    first Tokens message handled (`arrived`) to the flush counts for `detokenize`.
    """

    MAX_ENTRIES = 512  # sent at once past this: a full inbox must not hold text back

    def __init__(self, push: Callable[[str, protocol.Message], bool], stages: StageTimes) -> None:
        self._push = push
        self._stages = stages
        self._entries: dict[str, list[DeltaEntry]] = {}  # api worker -> entries, in order
        self._num_entries = 0
        self._scheduled = False
        self._since = 0.0  # perf_counter() of the first Tokens handled since the last flush

    def arrived(self) -> None:
        """A Tokens message is being handled: its text goes out at the next flush."""
        if not self._since:
            self._since = time.perf_counter()

    def __len__(self) -> int:
        return self._num_entries

    def add(self, reply_to: str, entry: DeltaEntry) -> None:
        batch = self._entries.get(reply_to)
        if batch is None:
            batch = self._entries[reply_to] = []
        batch.append(entry)
        self._num_entries += 1
        if self._num_entries >= self.MAX_ENTRIES:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_soon)

    def flush(self) -> None:
        """Send every entry held, one TextDelta per api worker."""
        entries, self._entries, self._num_entries = self._entries, {}, 0
        for reply_to, batch in entries.items():
            self._push(reply_to, text_delta(batch))
        if self._since:
            self._stages.observe("detokenize", time.perf_counter() - self._since)
            self._since = 0.0

    def send(self, reply_to: str, msg: protocol.Message) -> None:
        """Another message for an api worker, after all the text held (for any of them)."""
        self.flush()
        self._push(reply_to, msg)

    def _flush_soon(self) -> None:
        self._scheduled = False
        self.flush()
