"""http_protocol.py: a header timeout and half-closed requests, on a real EmbeddedServer
on loopback, with raw clients (asyncio streams) that do what curl or `nc -N` do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lmd.http_server import ConnectionLimits, EmbeddedServer, bind_tcp

ANSWER_AFTER_S = 0.5  # how long /slow thinks: longer than the header timeout below
HEADER_TIMEOUT_S = 0.3


class App:
    """/slow answers after ANSWER_AFTER_S, unless the client is gone first."""

    def __init__(self) -> None:
        self.disconnected = asyncio.Event()
        self.app = Starlette(routes=[Route("/slow", self.slow, methods=["GET", "POST"])])

    async def slow(self, request: Request) -> JSONResponse:
        await request.body()
        try:
            await asyncio.wait_for(self._gone(request), ANSWER_AFTER_S)
        except TimeoutError:
            return JSONResponse({"answer": "done"})
        self.disconnected.set()
        return JSONResponse({}, status_code=499)

    async def _gone(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass


@pytest.fixture
async def served() -> AsyncIterator[tuple[App, int]]:
    app = App()
    sock = bind_tcp("127.0.0.1", 0)
    limits = ConnectionLimits(header_timeout_s=HEADER_TIMEOUT_S)
    server = EmbeddedServer(app.app, sock, "info", limits)
    await server.start()
    try:
        yield app, sock.getsockname()[1]
    finally:
        await server.stop()


REQUEST = b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
REQUEST += b"Content-Length: 2\r\n\r\n{}"


def final_response(raw: bytes) -> bytes:
    """The response after any interim 1xx ones."""
    while raw.startswith(b"HTTP/1.1 1"):
        raw = raw.partition(b"\r\n\r\n")[2]
    return raw


async def test_a_half_closed_request_gets_its_answer(served: tuple[App, int]) -> None:
    """`nc -N`: the request, then shutdown(SHUT_WR), then read. Before: nothing came back."""
    app, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    writer.write_eof()
    raw = await asyncio.wait_for(reader.read(), 10)  # to the server's close
    response = final_response(raw)
    assert response.startswith(b"HTTP/1.1 200 OK\r\n"), raw
    assert response.endswith(b'{"answer":"done"}')
    assert not app.disconnected.is_set()
    writer.close()


async def test_a_half_closed_http10_request_gets_its_answer(served: tuple[App, int]) -> None:
    """No interim answers to an HTTP/1.0 client (RFC 9110 15.2)."""
    _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST.replace(b"HTTP/1.1", b"HTTP/1.0"))
    writer.write_eof()
    raw = await asyncio.wait_for(reader.read(), 10)
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n") and raw.endswith(b'{"answer":"done"}'), raw
    writer.close()


async def test_a_client_gone_entirely_is_still_noticed(served: tuple[App, int]) -> None:
    """A full close looks like a half-close until a write fails: the request is still
    aborted before its answer is due."""
    app, port = served
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    await writer.drain()
    await asyncio.sleep(0.05)  # the request is in
    writer.close()
    await asyncio.wait_for(app.disconnected.wait(), ANSWER_AFTER_S)


async def test_headers_not_complete_in_time_close_the_connection(
    served: tuple[App, int],
) -> None:
    """Before: a half-sent request kept its connection (and descriptor) open for good."""
    _, port = served
    for sent in (b"", b"GET /slow HTTP/1.1\r\nHost: t\r\n"):  # silent, or half the headers
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sent)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing answered
        writer.close()


async def test_the_header_timeout_spares_requests_and_covers_the_next_one(
    served: tuple[App, int],
) -> None:
    """Answers slower than the header timeout are unaffected; on a kept-alive connection
    the next request's headers get the timeout again."""
    _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    head = await asyncio.wait_for(reader.readuntil(b'{"answer":"done"}'), 5)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    writer.write(b"GET /slow HTTP/1.1\r\n")  # and no more
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
