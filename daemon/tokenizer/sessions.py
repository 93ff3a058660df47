"""Interactive sessions (LMDeploy's /v1/chat/interactive), kept by the tokenizer.

A session holds the conversation so far: its messages, the text the chat template
rendered for them, and the token ids the engine computed for that text (the earlier
prompts and the answers as sampled), so that the next turn's prompt starts with exactly
those ids and the engine's prefix cache serves their KV.

Life cycle of a session:
  1. `open(session_id, fresh=...)`: a turn arrives; an unknown id (or `fresh`, i.e.
     interactive_mode false) starts an empty session. A session already running a turn
     refuses a second one (SessionBusyError).
  2. `begin(session, request_id)`: the turn runs; the session is busy.
  3. `commit(...)` when the turn finished (its answer joins the history), or `release()`
     when it did not (aborted, failed, or a one-off turn): either way it is idle again.
  4. `end(session_id)` forgets it (a client's request); `expire()` forgets sessions idle
     for longer than the idle timeout; opening one more than `max_sessions` evicts the
     least recently used idle session.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from lmd.tokenizer.text.chat_template import ChatMessage, ChatTemplate, ChatTemplateError

DEFAULT_MAX_SESSIONS = 4096

Encode = Callable[[str], list[int]]  # text -> token ids, no special tokens added
Decode = Callable[[list[int]], str]  # token ids -> text, special tokens kept


class SessionError(ValueError):
    """A turn that cannot run in its session; the message says what to do."""


class SessionBusyError(SessionError):
    """The session is running a turn already."""


@dataclass(slots=True, eq=False)
class Session:
    session_id: int
    last_used: float  # clock seconds of the last open, commit or release
    messages: list[ChatMessage] = field(default_factory=list)  # closed turns
    text: str = ""  # `messages` rendered as history (every turn closed)
    token_ids: list[int] = field(default_factory=list)  # what the engine saw for `text`
    request_id: str | None = None  # the turn running now

    @property
    def is_busy(self) -> bool:
        return self.request_id is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def reset(self) -> None:
        self.messages, self.text, self.token_ids = [], "", []


class SessionTable:
    """Sessions by id, least recently used first."""

    def __init__(
        self,
        idle_timeout_s: float,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idle_timeout_s <= 0 or max_sessions < 1:
            raise ValueError("idle_timeout_s must be > 0 and max_sessions >= 1")
        self.idle_timeout_s = idle_timeout_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[int, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: int) -> bool:
        return session_id in self._sessions

    def get(self, session_id: int) -> Session | None:
        return self._sessions.get(session_id)

    @property
    def num_busy(self) -> int:
        return sum(1 for s in self._sessions.values() if s.is_busy)

    def open(self, session_id: int, *, fresh: bool) -> Session:
        """The session for a new turn (created if unknown; emptied when `fresh`).

        Raises SessionBusyError while it runs a turn, SessionError when the table is
        full of busy sessions.
        """
        self.expire()
        now = self._clock()
        session = self._sessions.get(session_id)
        if session is not None and session.is_busy:
            raise SessionBusyError(
                f"session {session_id} is busy with another request; wait for it to "
                "finish or stop it with cancel: true"
            )
        if session is None:
            self._make_room()
            session = self._sessions[session_id] = Session(session_id, now)
        elif fresh:
            session.reset()
        session.last_used = now
        self._sessions.move_to_end(session_id)
        return session

    def begin(self, session: Session, request_id: str) -> None:
        session.request_id = request_id

    def commit(
        self,
        session: Session,
        messages: list[ChatMessage],
        text: str,
        token_ids: list[int],
    ) -> None:
        """The turn finished: the history is now `messages`, rendered and tokenized."""
        session.messages, session.text, session.token_ids = messages, text, token_ids
        self.release(session)

    def release(self, session: Session) -> None:
        """The turn is over without changing the history."""
        session.request_id = None
        session.last_used = self._clock()
        if session.session_id in self._sessions:
            self._sessions.move_to_end(session.session_id)

    def end(self, session_id: int) -> Session | None:
        """Forget a session; the caller aborts its running request, if any."""
        return self._sessions.pop(session_id, None)

    def expire(self) -> list[int]:
        """Forget idle sessions unused for longer than the idle timeout; their ids."""
        deadline = self._clock() - self.idle_timeout_s
        gone = [
            sid for sid, s in self._sessions.items() if not s.is_busy and s.last_used < deadline
        ]
        for sid in gone:
            del self._sessions[sid]
        return gone

    def _make_room(self) -> None:
        if len(self._sessions) < self.max_sessions:
            return
        for sid, session in self._sessions.items():  # least recently used first
            if not session.is_busy:
                del self._sessions[sid]
                return
        raise SessionError(
            f"all {self.max_sessions} interactive sessions are busy; retry later or end one"
        )


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn's prompt: the whole chat, its text, its ids and how many are history."""

    messages: list[ChatMessage]  # the session's turns + this turn's messages
    text: str
    token_ids: list[int]
    num_history_tokens: int  # leading ids the session held (their KV is cached)


def start_turn(
    session: Session,
    new: list[ChatMessage],
    template: ChatTemplate,
    encode: Encode,
    *,
    bare_prompt: str | None = None,
) -> Turn:
    """The prompt of a turn adding `new` to `session`'s history.

    The history's token ids are kept as they are and only the new text is tokenized
    (`render_increment`), so the engine's prefix cache serves the history; when the
    template renders the longer chat differently, the whole chat is rendered again.
    `bare_prompt` (a string prompt) on an empty session goes through render_prompt,
    as LMDeploy's first turn does.
    """
    messages = session.messages + new
    if not session.token_ids:
        text = template.render_prompt(bare_prompt) if bare_prompt is not None else ""
        text = text or template.render(messages)
        return Turn(messages, text, encode(text), 0)
    try:
        increment = template.render_increment(session.text, messages)
    except ChatTemplateError:
        text = template.render(messages)
        return Turn(messages, text, encode(text), 0)
    ids = session.token_ids + encode(increment)
    return Turn(messages, session.text + increment, ids, session.num_tokens)


def finish_turn(
    turn: Turn,
    answer: str,
    output_ids: list[int],
    *,
    template: ChatTemplate,
    encode: Encode,
    decode: Decode,
) -> tuple[list[ChatMessage], str, list[int]]:
    """The history after a turn answered with `answer`: (messages, text, token ids).

    The ids are the prompt's and the sampled ones, as the engine computed them, plus
    the template's closing text after them (e.g. the newline after `<|im_end|>`); when
    the sampled tokens are not the start of the closed turn's text (a stop string cut
    it), the closing text is tokenized instead. Raises ChatTemplateError.
    """
    messages = [*turn.messages, ChatMessage("assistant", answer)]
    closed = template.render(messages, add_generation_prompt=False)
    if not closed.startswith(turn.text):
        return messages, closed, encode(closed)
    tail = closed[len(turn.text) :]
    sampled = decode(output_ids)
    if output_ids and tail.startswith(sampled):
        return messages, closed, turn.token_ids + output_ids + encode(tail[len(sampled) :])
    return messages, closed, turn.token_ids + encode(tail)
