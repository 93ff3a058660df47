"""A lean HTTP/1.1 keep-alive client for `lmd-bench front`.

The benchmark shares the machine's cores with the daemon it measures, so its own cost
per request must stay far below the server's: httpx spent more CPU per request than the
daemon's three processes together and was the bottleneck (docs/benchmarks.md, 'Second
session: the client was the bottleneck'). This client writes one pre-encoded request per
call and parses only what the benchmark needs: the status line, Content-Length or chunked
framing, and the body. One connection per concurrent worker; no redirects, TLS, cookies or
retries.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class HttpError(Exception):
    """A response the benchmark cannot use (bad status, framing or a closed connection)."""


class Connection:
    """One keep-alive HTTP/1.1 connection: one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        return cls(reader, writer)

    def close(self) -> None:
        self._writer.close()

    @staticmethod
    def post_request(host: str, path: str, body: bytes) -> bytes:
        """The bytes of a JSON POST, to encode once and send many times."""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def send(self, request: bytes) -> bytes:
        """Send a request; the whole body of its 200 response."""
        return b"".join([piece async for piece in self.stream(request)])

    async def stream(self, request: bytes) -> AsyncIterator[bytes]:
        """Send a request; its 200 response's body as it arrives (one piece per chunk)."""
        self._writer.write(request)
        try:
            head = await self._reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise HttpError(f"connection closed before a response: {exc}") from None
        status, length, chunked = _parse_head(head)
        if chunked:
            async for piece in self._chunks():
                yield piece
        else:
            yield await self._reader.readexactly(length)
        if status != 200:
            raise HttpError(f"HTTP {status}")

    async def _chunks(self) -> AsyncIterator[bytes]:
        while True:
            size_line = await self._reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            data = await self._reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                return
            yield data[:-2]


def _parse_head(head: bytes) -> tuple[int, int, bool]:
    """(status, content length, chunked) from a response's status line and headers."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HttpError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    length = 0
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    return int(parts[1]), length, chunked
