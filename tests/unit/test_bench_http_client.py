"""lmd-bench front's HTTP/1.1 client against a tiny server that speaks both framings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from lmd.bench.http_client import Connection, HttpError

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    b"7\r\ndata: a\r\n"
    b"a\r\n\n\ndata: bc\r\n"
    b"0\r\n\r\n"
)
SIZED = b'HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\n{"a": 1}'
FAILED = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}"


@pytest.fixture
async def port() -> AsyncIterator[int]:
    """A server answering, on one connection, by the path: /chunked, /sized, else 503."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            path = head.split(b" ")[1]
            writer.write({b"/chunked": CHUNKED, b"/sized": SIZED}.get(path, FAILED))
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def test_both_framings_and_errors_on_one_keep_alive_connection(port: int) -> None:
    conn = await Connection.open("127.0.0.1", port)
    try:
        chunked = Connection.post_request("127.0.0.1", "/chunked", b"{}")
        assert [piece async for piece in conn.stream(chunked)] == [b"data: a", b"\n\ndata: bc"]
        assert await conn.send(Connection.post_request("127.0.0.1", "/sized", b"{}")) == b'{"a": 1}'
        with pytest.raises(HttpError, match="HTTP 503"):
            await conn.send(Connection.post_request("127.0.0.1", "/other", b"[]"))
        assert await conn.send(chunked) == b"data: a\n\ndata: bc"  # still in step after a 503
    finally:
        conn.close()
