"""`lmd-bench serve`: a dropped request says what broke it (issue 18's H100 runs reported
`dropped: ReadError` and `Server disconnected without sending a response` and no more:
not whether the connection was new or reused, nor whether an answer had begun).

A raw asyncio server answers each request by its path and the request's number on its
connection: a complete JSON answer (keeps the connection), a reset (SO_LINGER 0), a close
without a word, or the head and first chunk of a stream, then a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable

from lmd.bench.serve_client import Target, http_client, send
from lmd.bench.serve_data import Prompt

MODELS = b'{"object":"list","data":[{"id":"m"}]}'
PROMPT = Prompt("hello", input_len=1, output_len=4)
Answer = Callable[[asyncio.StreamWriter], None]


def models(w: asyncio.StreamWriter) -> None:
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    w.write(b"content-length: %d\r\n\r\n%s" % (len(MODELS), MODELS))


def reset(w: asyncio.StreamWriter) -> None:
    sock = w.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


def hang_up(w: asyncio.StreamWriter) -> None:
    w.close()


def stream_then_reset(w: asyncio.StreamWriter) -> None:
    event = b'data: {"choices": [{"text": "a"}]}\n\n'
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
    w.write(b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event))
    asyncio.get_running_loop().call_later(0.05, reset, w)


async def drop(first: Answer | None, then: Answer) -> str:
    """The `dropped` message of a streamed request that the server answers with `then`,
    after `first` answered a GET /v1/models on the same client (None: no GET first)."""
    answers = [a for a in (first, then) if a is not None]

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
            if length:
                await reader.readexactly(int(length[0].split(b":")[1]))
            answers.pop(0)(writer)
            with contextlib.suppress(ConnectionError):  # reset or closed by the answer
                await writer.drain()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = Target(url=f"http://127.0.0.1:{port}", model="m", timeout_s=10)
    async with http_client(target) as client:
        if first is not None:
            assert (await client.get("/v1/models")).status_code == 200
        result = await send(client, target, PROMPT)
    server.close()
    assert result.error == "dropped", result
    return result.error_message


async def test_a_reset_before_any_answer_names_the_reset_and_a_new_connection() -> None:
    message = await drop(None, reset)
    assert "ReadError" in message and "Connection reset by peer" in message, message
    assert message.endswith("on a new connection, before any response"), message


async def test_a_reused_connection_closed_under_the_request_says_so() -> None:
    """The signature of a server closing an idle kept-alive connection as it is reused."""
    message = await drop(models, hang_up)
    assert "Server disconnected without sending a response" in message, message
    assert message.endswith("on a reused connection, before any response"), message


async def test_a_stream_cut_short_says_the_response_had_begun() -> None:
    message = await drop(None, stream_then_reset)
    assert message.endswith("on a new connection, after the response began"), message
