"""A multi-turn chat kept in the caller's process (`Pipeline.chat`, LMDeploy's Session).

It keeps what the tokenizer process keeps for an interactive session (tokenizer/
sessions.py, whose start_turn and finish_turn it reuses): the messages so far, their text
as the chat template renders them, and the token ids the engine computed for that text,
so that the next turn's prompt starts with exactly those ids (with
`enable_prefix_caching`, the engine serves their KV from its cache).

Life cycle: Session() -> pipe.chat(prompt, session) starts a turn (`start`) -> the turn's
answer joins the history when it finishes (`finish`), not when it was cut off -> more
turns -> `reset()` forgets everything.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from lmd.pipeline.outputs import Response
from lmd.pipeline.prompts import Prompter
from lmd.tokenizer.sessions import Session as History
from lmd.tokenizer.sessions import Turn, finish_turn, start_turn
from lmd.tokenizer.text.chat_template import ChatMessage, parse_messages

_ids = itertools.count(1)


@dataclass(eq=False)
class Session:
    """history: (the user's prompt, the answer's text) per finished turn; response: the
    last turn's Response."""

    session_id: int = field(default_factory=lambda: next(_ids))
    history: list[tuple[str | list[dict[str, Any]], str]] = field(default_factory=list)
    response: Response | None = None
    _state: History = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._state = History(self.session_id, time.monotonic())

    @property
    def step(self) -> int:
        """Tokens the conversation holds (LMDeploy's session step)."""
        return self._state.num_tokens

    def reset(self) -> None:
        self.history, self.response = [], None
        self._state.reset()

    def start(self, prompt: str | list[dict[str, Any]], prompter: Prompter) -> Turn:
        """The turn's prompt: the history's ids + the new turn's text tokenized."""
        template = prompter.need_template()
        if isinstance(prompt, str):
            new, bare = [ChatMessage("user", prompt)], prompt
        else:
            new, bare = parse_messages(prompt), None
        turn = start_turn(self._state, new, template, prompter.encode, bare_prompt=bare)
        if not turn.token_ids:
            raise ValueError("the prompt is empty")
        return turn

    def finish(
        self,
        prompt: str | list[dict[str, Any]],
        turn: Turn,
        response: Response,
        prompter: Prompter,
    ) -> None:
        """The turn is over: its answer joins the history unless it was cut off."""
        self.response = response
        if response.finish_reason in (None, "abort"):
            return
        messages, text, ids = finish_turn(
            turn,
            response.text,
            response.token_ids,
            template=prompter.need_template(),
            encode=prompter.encode,
            decode=prompter.decode,
        )
        self._state.messages, self._state.text, self._state.token_ids = messages, text, ids
        self.history.append((prompt, response.text))
