"""What the tokenizer keeps of one request in flight, and the TextDelta it sends the api."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmd import protocol
from lmd.routing import Route
from lmd.sessions import Session, Turn
from lmd.text.in_order import InOrder
from lmd.text.stream import StreamUpdate, TextStream

# One output token as an engine sent it: (token id, finish reason, logprobs, cached tokens).
Entry = tuple[int, str | None, dict[str, Any] | None, int]


@dataclass(slots=True)
class TokenizerRequest:
    reply_to: str  # api worker
    route: Route
    stream: TextStream
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


def text_delta(entries: list[tuple[str, TokenizerRequest, StreamUpdate]]) -> protocol.TextDelta:
    """One TextDelta for one api worker: each request's new text of this step."""
    return protocol.TextDelta(
        [rid for rid, _, _ in entries],
        [u.text for _, _, u in entries],
        [u.finish_reason for _, _, u in entries],
        [r.stream.num_prompt_tokens for _, r, _ in entries],
        [r.stream.num_completion_tokens for _, r, _ in entries],
        [u.logprobs for _, _, u in entries],
        [r.cached_tokens or 0 for _, r, _ in entries],
        [r.num_history_tokens for _, r, _ in entries],
    )
