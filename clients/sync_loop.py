"""SyncLoop: the base of a sync twin (Client, SyncControlClient) of an async client.

A twin owns an event loop of its own and runs each call of the async client to completion
on it, in the calling thread. So it must not be used inside a running asyncio loop (use
the async client there): `run_until_complete` refuses with RuntimeError.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterator
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

T = TypeVar("T")


class AsyncClosable(Protocol):
    async def aclose(self) -> None: ...


A = TypeVar("A", bound=AsyncClosable)


class SyncLoop(Generic[A]):
    """Runs the calls of the async client `A` on an event loop that this object owns."""

    def __init__(self, client: A) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = client

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the async client, then the loop; calling it again does nothing."""
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.aclose())
            self._loop.close()

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        """One call of the async client, to completion."""
        return self._loop.run_until_complete(call)

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
