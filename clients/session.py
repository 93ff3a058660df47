"""Session: a conversation the server remembers, over LMDeploy's /v1/chat/interactive.

    async with client.session(temperature=0) as chat:
        print((await chat.send("My name is Ada.")).text)
        turn = await chat.send("What is my name?")   # only the new turn travels;
        print(turn.text, turn.cached_tokens)          # the history's KV is reused

Each turn sends only the new user text; the server keeps the history and its KV (prefix
cache). Leaving the `async with` ends the session on the server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import orjson

from lmd_client.errors import LmdError

PATH = "/v1/chat/interactive"


class Transport(Protocol):
    """What a Session needs of its client (AsyncClient is one): a JSON request and a
    stream, both retried on connection refused and 503, both raising LmdError."""

    async def _json(self, method: str, path: str, body: Any = None) -> dict[str, Any]: ...

    def _open_stream(
        self, path: str, body: dict[str, Any]
    ) -> AbstractAsyncContextManager[httpx.Response]: ...


@dataclass(frozen=True, slots=True)
class Turn:
    """One answer (or, streamed, one piece of it) and its token counts."""

    text: str
    finish_reason: str | None
    tokens: int  # generated so far
    input_tokens: int  # this turn's new prompt tokens
    history_tokens: int  # tokens the session brought
    cached_tokens: int  # prompt tokens served from the prefix cache

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Turn:
        return cls(
            str(body.get("text", "")),
            body.get("finish_reason"),
            int(body.get("tokens", 0)),
            int(body.get("input_tokens", 0)),
            int(body.get("history_tokens", 0)),
            int(body.get("cached_tokens", 0)),
        )


class Session:
    def __init__(self, client: Transport, session_id: int, defaults: Mapping[str, Any]) -> None:
        self.client = client
        self.session_id = session_id
        self.defaults = dict(defaults)

    def _body(self, prompt: str, params: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
        return {
            **self.defaults,
            **params,
            "prompt": prompt,
            "session_id": self.session_id,
            "interactive_mode": True,
            **fields,
        }

    async def send(self, prompt: str, **params: Any) -> Turn:
        """One turn; returns the whole answer."""
        body = await self.client._json("POST", PATH, self._body(prompt, params, stream=False))
        return Turn.from_body(body)

    async def stream(self, prompt: str, **params: Any) -> AsyncIterator[Turn]:
        """One turn, piece by piece (each Turn's text is the new piece)."""
        body = self._body(prompt, params, stream=True)
        async with self.client._open_stream(PATH, body) as response:
            async for line in response.aiter_lines():
                if line.strip():
                    yield Turn.from_body(_checked_line(line))

    async def cancel(self) -> None:
        """Stop the turn that is running in this session."""
        await self.client._json("POST", PATH, self._body("", {}, cancel=True))

    async def end(self) -> None:
        """Forget the session on the server (its history and its hold on the KV)."""
        await self.client._json("POST", PATH, self._body("", {}, interactive_mode=False))


def _checked_line(line: str) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(line)
    if "error" in body:
        err = body["error"]
        raise LmdError(500, str(err.get("type", "error")), str(err.get("message", "")))
    return body
