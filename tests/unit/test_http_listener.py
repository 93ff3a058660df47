"""http_listener.py: the cap on open connections and running out of file descriptors, on
a real EmbeddedServer (in a child process with a low RLIMIT_NOFILE for the latter)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from lmd.http_listener import default_max_connections
from lmd.http_server import ConnectionLimits, EmbeddedServer, bind_tcp

PING = b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n"


async def ping(request: Request) -> PlainTextResponse:
    return PlainTextResponse("pong")


APP = Starlette(routes=[Route("/ping", ping)])


@pytest.fixture
async def capped() -> AsyncIterator[tuple[EmbeddedServer, int]]:
    sock = bind_tcp("127.0.0.1", 0)
    server = EmbeddedServer(APP, sock, "info", ConnectionLimits(max_connections=2))
    await server.start()
    try:
        yield server, sock.getsockname()[1]
    finally:
        await server.stop()


async def test_connections_past_the_cap_get_503_at_once(
    capped: tuple[EmbeddedServer, int],
) -> None:
    server, port = capped
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    for reader, writer in held:  # served: the cap counts them
        writer.write(PING)
        assert (await reader.readuntil(b"pong")).startswith(b"HTTP/1.1 200 OK")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = await asyncio.wait_for(reader.read(), 5)  # answered and closed without a request
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
    assert orjson.loads(body)["error"]["code"] == "too_many_connections"
    assert server.listener.num_refused == 1
    writer.close()

    held[0][1].close()  # one slot free again
    await held[0][1].wait_closed()
    for _ in range(100):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(PING)
        raw = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
        if raw.startswith(b"HTTP/1.1 200 OK"):
            break
        await asyncio.sleep(0.02)  # the server had not seen the close yet
    assert raw.startswith(b"HTTP/1.1 200 OK"), raw
    held[1][1].close()


def test_the_default_cap_is_what_the_open_files_limit_leaves() -> None:
    code = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300));"
    code += "from lmd.http_listener import default_max_connections as d; print(d())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 150 < int(out.stdout) < 300 - 64  # the limit less what is open less HEADROOM
    assert default_max_connections() > 1000  # this process's limit is higher


# A server whose process may open only a few descriptors beyond those it starts with.
SERVER = textwrap.dedent(
    """
    import asyncio, os, resource, sys
    import uvloop
    from tests.unit.test_http_listener import APP
    from lmd.http_server import ConnectionLimits, EmbeddedServer, bind_tcp

    async def main() -> None:
        sock = bind_tcp("127.0.0.1", 0)
        limits = ConnectionLimits(max_connections=100_000, header_timeout_s=60)
        server = EmbeddedServer(APP, sock, "info", limits)
        await server.start()
        in_use = len(os.listdir("/proc/self/fd"))
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 20, hard))
        print(sock.getsockname()[1], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop()

    uvloop.run(main())  # the loop the daemon runs
    """
)


def test_running_out_of_descriptors_sheds_load_and_recovers() -> None:
    """Past its open-files limit the server answers 503 instead of resetting clients or
    going deaf, and serves again once descriptors come back."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}  # the checkout
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(60)]
        time.sleep(0.5)  # let it accept what it can
        refused, held = 0, 0
        for c in clients:
            c.setblocking(False)
            try:
                raw = c.recv(4096)
            except BlockingIOError:
                held += 1  # accepted (or waiting in the backlog), not answered
                continue
            assert raw.startswith(b"HTTP/1.1 503 "), raw
            refused += 1
        assert refused >= 30 and held >= 10, (refused, held)
        for c in clients:
            c.close()
        answer = b""
        for _ in range(50):  # until the closes reach it
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(PING)
                answer = c.recv(4096)
            if answer.startswith(b"HTTP/1.1 200 OK"):
                break
            time.sleep(0.1)
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer
        assert proc.poll() is None  # still serving, never died
    finally:
        _, err = proc.communicate(b"", timeout=10)
    log = err.decode()
    assert log.count("out of file descriptors") == 1, log  # once, not per connection
