"""Client: AsyncClient without await, for scripts and notebooks.

    with Client("http://127.0.0.1:23333") as client:
        print(client.chat([{"role": "user", "content": "Hi"}], max_tokens=16).text)
        for delta in client.stream_complete("Once upon a time", max_tokens=32):
            print(delta.text, end="")

It runs its own event loop (sync_loop.py): do not use it inside a running asyncio loop
(use AsyncClient).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from lmd_client.openai_client import AsyncClient, Completion, Delta, Messages
from lmd_client.sync_loop import SyncLoop


class Client(SyncLoop[AsyncClient]):
    def __init__(
        self, base_url: str = "http://127.0.0.1:23333", api_key: str | None = None, **options: Any
    ) -> None:
        super().__init__(AsyncClient(base_url, api_key, **options))

    def health(self) -> dict[str, Any]:
        return self._run(self._client.health())

    def models(self) -> list[str]:
        return self._run(self._client.models())

    def chat(self, messages: Messages, **params: Any) -> Completion:
        return self._run(self._client.chat(messages, **params))

    def complete(self, prompt: str | Sequence[int], **params: Any) -> Completion:
        return self._run(self._client.complete(prompt, **params))

    def stream_chat(self, messages: Messages, **params: Any) -> Iterator[Delta]:
        return self._iterate(self._client.stream_chat(messages, **params))

    def stream_complete(self, prompt: str | Sequence[int], **params: Any) -> Iterator[Delta]:
        return self._iterate(self._client.stream_complete(prompt, **params))
