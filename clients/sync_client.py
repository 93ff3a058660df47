"""Client: AsyncClient without await, for scripts and notebooks.

    with Client("http://127.0.0.1:23333") as client:
        print(client.chat([{"role": "user", "content": "Hi"}], max_tokens=16).text)
        for delta in client.stream_complete("Once upon a time", max_tokens=32):
            print(delta.text, end="")

It runs its own event loop: do not use it inside a running asyncio loop (use AsyncClient).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from lmd_client.openai_client import AsyncClient, Completion, Delta, Messages

T = TypeVar("T")


class Client:
    def __init__(
        self, base_url: str = "http://127.0.0.1:23333", api_key: str | None = None, **options: Any
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = AsyncClient(base_url, api_key, **options)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.aclose())
            self._loop.close()

    def health(self) -> dict[str, Any]:
        return self._loop.run_until_complete(self._client.health())

    def models(self) -> list[str]:
        return self._loop.run_until_complete(self._client.models())

    def chat(self, messages: Messages, **params: Any) -> Completion:
        return self._loop.run_until_complete(self._client.chat(messages, **params))

    def complete(self, prompt: str | Sequence[int], **params: Any) -> Completion:
        return self._loop.run_until_complete(self._client.complete(prompt, **params))

    def stream_chat(self, messages: Messages, **params: Any) -> Iterator[Delta]:
        return self._iterate(self._client.stream_chat(messages, **params))

    def stream_complete(self, prompt: str | Sequence[int], **params: Any) -> Iterator[Delta]:
        return self._iterate(self._client.stream_complete(prompt, **params))

    def _iterate(self, stream: AsyncIterator[T]) -> Iterator[T]:
        """Step an async stream from this thread; leaving the loop early closes it."""
        try:
            while True:
                try:
                    yield self._loop.run_until_complete(anext(stream))
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None and not self._loop.is_closed():
                self._loop.run_until_complete(aclose())
