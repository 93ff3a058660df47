"""An interactive session's turns in the tokenizer: each turn's prompt, and what stays of
it in the session's history when it is over (sessions.py keeps the sessions)."""

from __future__ import annotations

import logging

from lmd import protocol
from lmd.tokenizer.request import TokenizerRequest
from lmd.tokenizer.sessions import (
    Decode,
    Encode,
    Session,
    SessionTable,
    Turn,
    finish_turn,
    start_turn,
)
from lmd.tokenizer.text.chat_template import (
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    parse_messages,
)

log = logging.getLogger(__name__)


class Turns:
    """Starts and closes the turns of `sessions` with the model's template and codec."""

    def __init__(
        self, sessions: SessionTable, template: ChatTemplate, encode: Encode, decode: Decode
    ) -> None:
        self.sessions = sessions
        self.template = template
        self.encode = encode
        self.decode = decode

    def start(self, session: Session, msg: protocol.TextRequest) -> Turn:
        """A turn's prompt: the session's history + the new messages."""
        if msg.messages is not None:
            new = parse_messages(msg.messages)
        else:
            new = [ChatMessage("user", msg.prompt or "")]
        turn = start_turn(session, new, self.template, self.encode, bare_prompt=msg.prompt)
        if not turn.token_ids:
            raise ValueError("the prompt is empty")
        return turn

    def close(self, request: TokenizerRequest, *, keep: bool) -> None:
        """The turn is over: keep its answer in the session's history, or not."""
        session, turn = request.session, request.turn
        assert session is not None and turn is not None
        if not (keep and request.keep_turn):
            self.sessions.release(session)
            if not request.keep_turn:  # a one-off turn: LMDeploy ends its session
                self.sessions.end(session.session_id)
            return
        try:
            history = finish_turn(
                turn,
                "".join(request.answer),
                request.output_ids,
                template=self.template,
                encode=self.encode,
                decode=self.decode,
            )
        except ChatTemplateError as exc:
            log.warning("session %d starts afresh: %s", session.session_id, exc)
            session.reset()
            self.sessions.release(session)
            return
        self.sessions.commit(session, *history)
