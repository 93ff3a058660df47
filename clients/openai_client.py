"""AsyncClient: lmd's OpenAI-compatible API from Python, with httpx and orjson only.

    async with AsyncClient("http://127.0.0.1:23333") as client:
        reply = await client.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
        print(reply.text, reply.finish_reason, reply.usage.completion_tokens)
        async for delta in client.stream_chat([{"role": "user", "content": "Hi"}]):
            print(delta.text, end="")

Extra keyword arguments are sent as request fields (temperature, top_p, top_k, stop,
seed, ignore_eos, ...). A request that cannot connect, or that gets 503, is retried with
exponential backoff (honouring Retry-After) up to `max_retries` times; a stream is never
retried once its first byte arrived. Cancelling the task that iterates a stream closes
the connection, and the server aborts the request and frees what it held.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
import orjson

from lmd_client.errors import LmdError
from lmd_client.session import Session

Messages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def from_body(cls, body: Mapping[str, Any] | None) -> Usage:
        body = body or {}
        return cls(
            int(body.get("prompt_tokens", 0)),
            int(body.get("completion_tokens", 0)),
            int(body.get("total_tokens", 0)),
        )


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole answer: its text, why it ended, and the token counts."""

    id: str
    text: str
    finish_reason: str | None
    usage: Usage
    raw: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed piece; the last carries finish_reason, a usage chunk carries usage."""

    text: str
    finish_reason: str | None
    usage: Usage | None


class AsyncClient:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:23333",
        api_key: str | None = None,
        *,
        model: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)
        self.model = model
        self.max_retries = max_retries
        self.backoff_s = backoff_s

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # Plain endpoints -------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        """`/health` as `{"status", ...}`, whatever its HTTP status (503 while starting)."""
        response = await self._http.get("/health")
        body: dict[str, Any] = orjson.loads(response.content)
        return body

    async def models(self) -> list[str]:
        body = await self._json("GET", "/v1/models")
        return [card["id"] for card in body["data"]]

    async def chat(self, messages: Messages, **params: Any) -> Completion:
        body = await self._json(
            "POST", "/v1/chat/completions", await self._body(params, messages=list(messages))
        )
        choice = body["choices"][0]
        return Completion(
            body["id"],
            choice["message"]["content"] or "",
            choice["finish_reason"],
            Usage.from_body(body.get("usage")),
            body,
        )

    async def complete(self, prompt: str | Sequence[int], **params: Any) -> Completion:
        body = await self._json(
            "POST", "/v1/completions", await self._body(params, prompt=_prompt(prompt))
        )
        choice = body["choices"][0]
        return Completion(
            body["id"],
            choice["text"],
            choice["finish_reason"],
            Usage.from_body(body.get("usage")),
            body,
        )

    # Streams ---------------------------------------------------------------------------

    async def stream_chat(self, messages: Messages, **params: Any) -> AsyncIterator[Delta]:
        body = await self._body(params, messages=list(messages), stream=True)
        async for chunk in self._stream("/v1/chat/completions", body):
            yield _delta(chunk, lambda c: c.get("delta", {}).get("content") or "")

    async def stream_complete(
        self, prompt: str | Sequence[int], **params: Any
    ) -> AsyncIterator[Delta]:
        body = await self._body(params, prompt=_prompt(prompt), stream=True)
        async for chunk in self._stream("/v1/completions", body):
            yield _delta(chunk, lambda c: c.get("text") or "")

    # Sessions (LMDeploy's /v1/chat/interactive) ------------------------------------------

    @asynccontextmanager
    async def session(self, **defaults: Any) -> AsyncIterator[Session]:
        """A conversation the server remembers; `defaults` go with every turn."""
        chat = Session(self, secrets.randbelow(2**62), defaults)
        try:
            yield chat
        finally:
            await chat.end()

    # Plumbing --------------------------------------------------------------------------

    async def _body(self, params: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
        model = params.get("model") or self.model
        if model is None:
            self.model = model = (await self.models())[0]
        return {**params, **fields, "model": model}

    async def _json(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        content = None if body is None else orjson.dumps(body)
        for attempt in range(self.max_retries + 1):
            try:
                response = await self._http.request(
                    method, path, content=content, headers=_JSON_HEADERS
                )
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise LmdError(0, "connection_error", f"{exc!r}") from exc
                await asyncio.sleep(self._delay(attempt, None))
                continue
            if response.status_code == 503 and attempt < self.max_retries:
                await asyncio.sleep(self._delay(attempt, response.headers.get("retry-after")))
                continue
            return _checked(response.status_code, response.content)
        raise AssertionError("unreachable")

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async with self._open_stream(path, body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return
                chunk = orjson.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    raise LmdError(500, err.get("type", "error"), err.get("message", ""))
                yield chunk

    @asynccontextmanager
    async def _open_stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[httpx.Response]:
        """A response whose status is 200; retried like _json until the first byte."""
        content = orjson.dumps(body)
        for attempt in range(self.max_retries + 1):
            try:
                request = self._http.build_request(
                    "POST", path, content=content, headers=_JSON_HEADERS
                )
                response = await self._http.send(request, stream=True)
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise LmdError(0, "connection_error", f"{exc!r}") from exc
                await asyncio.sleep(self._delay(attempt, None))
                continue
            try:
                if response.status_code == 503 and attempt < self.max_retries:
                    retry_after = response.headers.get("retry-after")
                    await response.aclose()
                    await asyncio.sleep(self._delay(attempt, retry_after))
                    continue
                if response.status_code != 200:
                    _checked(response.status_code, await response.aread())
                yield response
                return
            finally:
                await response.aclose()  # closing early is how the server learns to abort
        raise AssertionError("unreachable")

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        backoff = self.backoff_s * 2.0**attempt
        if retry_after is not None and retry_after.isdigit():
            return min(float(retry_after), 30.0)
        return backoff


_JSON_HEADERS = {"Content-Type": "application/json"}


def _prompt(prompt: str | Sequence[int]) -> str | list[int]:
    return prompt if isinstance(prompt, str) else list(prompt)


def _checked(status: int, content: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = None
    if status >= 400 or not isinstance(body, dict):
        err = (body or {}).get("error", {}) if isinstance(body, dict) else {}
        raise LmdError(
            status, str(err.get("type", "error")), str(err.get("message", content[:200]))
        )
    return body


def _delta(chunk: dict[str, Any], text_of: Callable[[dict[str, Any]], str]) -> Delta:
    usage = Usage.from_body(chunk["usage"]) if chunk.get("usage") else None
    if not chunk.get("choices"):
        return Delta("", None, usage)
    choice = chunk["choices"][0]
    return Delta(text_of(choice), choice.get("finish_reason"), usage)
