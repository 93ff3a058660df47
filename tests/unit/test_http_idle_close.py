"""http_protocol.py and http_server.py: no connection reset for a request that has come
(issue 18: 2-4 of 512-1,024 streamed requests at concurrency 256 ended in httpx ReadError).

The api's workers run uvloop, whose loop runs the timers that are due before it reads the
sockets. A keep-alive (or header) timer that came due while the loop was busy closed a
connection whose next request was already in the socket, unread: the kernel answers that
with a reset (TcpExtTCPAbortOnData), and the client, which had sent its request on a
connection it was entitled to reuse, read ECONNRESET. Here the loop is held (time.sleep)
across the timer's deadline right after the request went out, which is what a busy api
loop does; the test server and client share that loop.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Awaitable, Callable

import httpx
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lmd.http_protocol import bytes_waiting
from lmd.http_server import (
    KEEP_ALIVE_S,
    ConnectionLimits,
    EmbeddedServer,
    bind_tcp,
    listen_backlog,
)

IDLE_S = 0.3  # the test servers' keep-alive and header timeouts
HELD_S = 0.2  # how long the loop is held: past the deadline
REQUEST = b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n"
SHORT = ConnectionLimits(header_timeout_s=IDLE_S, keep_alive_s=IDLE_S)
HTTPX_EXPIRY_S = httpx.Limits().keepalive_expiry or 5.0


async def ok(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


async def with_server(
    scenario: Callable[[int], Awaitable[None]], limits: ConnectionLimits = SHORT
) -> None:
    app = Starlette(routes=[Route("/ok", ok)])
    sock = bind_tcp("127.0.0.1", 0)
    server = EmbeddedServer(app, sock, "warning", limits)
    await server.start()
    try:
        await scenario(sock.getsockname()[1])
    finally:
        await server.stop()


async def answer(reader: asyncio.StreamReader) -> bytes:
    """One whole response to REQUEST (its body is the last thing in it)."""
    return await asyncio.wait_for(reader.readuntil(b'{"ok":true}'), 5)


def send_then_hold_the_loop(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Write `data` from inside an I/O callback that then holds the loop for HELD_S, as a
    busy api's callbacks do: the loop runs its due timers before it polls the sockets
    again, and the server's socket holds `data`, unread, when they run."""
    loop = asyncio.get_running_loop()
    wake, ring = socket.socketpair()

    def busy() -> None:
        loop.remove_reader(wake.fileno())
        writer.write(data)  # in the server's socket at once (loopback)
        time.sleep(HELD_S)
        wake.close()
        ring.close()

    loop.add_reader(wake.fileno(), busy)
    ring.send(b"!")


async def reuse_at_the_keep_alive_deadline(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    assert (await answer(reader)).startswith(b"HTTP/1.1 200 OK")
    await asyncio.sleep(IDLE_S - 0.1)  # kept alive, still inside the server's idle time
    send_then_hold_the_loop(writer, REQUEST)  # the next request on it, then a busy loop
    assert (await answer(reader)).startswith(b"HTTP/1.1 200 OK")  # before: ConnectionResetError
    writer.close()


async def headers_at_the_header_deadline(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.sleep(IDLE_S - 0.1)
    send_then_hold_the_loop(writer, REQUEST)  # complete headers, inside the header timeout
    assert (await answer(reader)).startswith(b"HTTP/1.1 200 OK")  # before: ConnectionResetError
    writer.close()


async def a_trickle_still_times_out(port: int) -> None:
    """The grace a waiting byte buys is one short wait, once: half-sent headers still close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.sleep(IDLE_S - 0.1)
    send_then_hold_the_loop(writer, b"GET /ok HTTP/1.1\r\n")
    await asyncio.sleep(HELD_S)
    began = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing answered
    assert time.monotonic() - began < 1.0
    writer.close()


def test_a_request_sent_as_the_keep_alive_timer_fires_is_answered() -> None:
    uvloop.run(with_server(reuse_at_the_keep_alive_deadline))


def test_headers_complete_as_the_header_timer_fires_are_answered() -> None:
    uvloop.run(with_server(headers_at_the_header_deadline))


def test_headers_trickled_past_the_header_timeout_still_close() -> None:
    uvloop.run(with_server(a_trickle_still_times_out))


async def reuse_after_the_clients_expiry(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    await answer(reader)
    await asyncio.sleep(HTTPX_EXPIRY_S + 0.3)  # the longest an httpx client keeps it idle
    writer.write(REQUEST)
    assert (await answer(reader)).startswith(b"HTTP/1.1 200 OK")  # before: closed at 5 s
    writer.close()


def test_idle_connections_outlive_the_clients_pools() -> None:
    """The client, not the server, closes an idle connection: httpx (so the OpenAI SDK and
    lmd-bench) expires idle pooled connections after 5 s, aiohttp after 15 s, nginx's and
    cloud load balancers' upstream pools after 60 s. uvicorn's default was 5 s, httpx's
    too: the two raced for every connection reused near 5 s idle."""
    assert max(HTTPX_EXPIRY_S, 15, 60) < KEEP_ALIVE_S
    uvloop.run(with_server(reuse_after_the_clients_expiry, ConnectionLimits()))


def test_the_listen_backlog_is_what_the_kernel_allows() -> None:
    """A burst of connections beyond the backlog has SYNs dropped (1-3 s each for its
    client). Before: listen(1024) where net.core.somaxconn allowed 4096."""
    sock = bind_tcp("127.0.0.1", 0)
    try:
        # struct tcp_info of a listening socket: tcpi_sacked holds its backlog (Linux).
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        backlog = struct.unpack_from("I", info, 28)[0]  # u32 after 8 bytes and 5 u32
    finally:
        sock.close()
    assert backlog == listen_backlog()
    with open("/proc/sys/net/core/somaxconn") as f:
        assert backlog == int(f.read())


def test_a_timer_that_fires_after_the_close_finds_nothing_waiting() -> None:
    """The keep-alive timer of a connection whose socket is already closed (fileno -1):
    on an H100 run this raised ValueError in the timer callback (logged by asyncio)."""
    closed = socket.socket()
    closed.close()

    class Transport(asyncio.BaseTransport):
        def get_extra_info(self, name: str, default: object = None) -> object:
            return closed if name == "socket" else default

    assert bytes_waiting(Transport()) == 0
