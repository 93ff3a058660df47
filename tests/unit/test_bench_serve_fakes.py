"""Fakes for the `lmd-bench serve` tests, and tests that they behave as scripted.

- `FakeOpenAI`: a tiny HTTP/1.1 server (raw asyncio) that answers /v1/models and streams
  /v1/completions or /v1/chat/completions as a `Script` says: when each chunk goes out,
  how many tokens usage reports, or a 500, an error event, a dropped connection, a hang.
- `VirtualClockLoop`: an event loop whose clock stands still while anything can run and
  jumps to the next timer when everything waits. The server's scripted sleeps and the
  client's clock (`loop.time`) then agree exactly, whatever the machine's load, so that
  the benchmark's figures can be checked to the microsecond.
"""

from __future__ import annotations

import asyncio
import selectors
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

T = TypeVar("T")
# Real time the loop waits for I/O before it concludes that only timers are left. Loopback
# TCP delivers a write before send() returns, so this only has to cover a scheduling blip.
REAL_GRACE_S = 0.005


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is not None and timeout <= 0:
            return list(super().select(0))
        ready = list(super().select(REAL_GRACE_S))
        if ready:
            return ready
        if timeout is None:  # no timer at all: only I/O can wake us
            return list(super().select(None))
        self._loop.now += timeout  # nothing to do until the next timer: go there
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@dataclass
class Script:
    """How the fake server answers one completion request (times in seconds)."""

    ttft: float = 0.0  # before the first text chunk
    gaps: list[float] = field(default_factory=list)  # before each further text chunk
    completion_tokens: int | None = None  # reported in a usage chunk; None: no usage chunk
    prompt_tokens: int = 7
    cached_tokens: int = 0  # reported as usage.prompt_tokens_details.cached_tokens
    status: int = 200
    error_after: int | None = None  # an error event after this many text chunks
    drop_after: int | None = None  # the connection cut after this many text chunks
    hang: bool = False  # headers, then nothing
    finish: bool = True  # a finish_reason and [DONE] at the end


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: Any) -> bytes:
    return _chunk(b"data: " + orjson.dumps(obj) + b"\n\n")


class FakeOpenAI:
    """Serves until `close()`; `script(body)` decides each completion's answer."""

    def __init__(self, script: Callable[[dict[str, Any]], Script]) -> None:
        self.script = script
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._handlers.discard(task)
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        if method == "GET":
            models = {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}
            self._reply(w, 200, models if path == "/v1/models" else {"status": "ok"})
            return True
        request = orjson.loads(body)
        self.bodies.append(request)
        self.headers.append(headers)
        return await self._stream(w, request, self.script(request))

    @staticmethod
    def _reply(w: asyncio.StreamWriter, status: int, obj: Any) -> None:
        data = orjson.dumps(obj)
        w.write(b"HTTP/1.1 %d X\r\nserver: fake-openai\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (status, len(data), data))  # fmt: skip

    async def _stream(self, w: asyncio.StreamWriter, request: dict[str, Any], s: Script) -> bool:
        if s.status != 200:
            self._reply(w, s.status, {"error": {"message": "scripted failure", "code": s.status}})
            return True
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        chat = "messages" in request
        if chat:  # like lmd and vLLM: a role-only chunk at once, before any text
            w.write(_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        if s.hang:
            await asyncio.sleep(1e6)
        for i, delay in enumerate([s.ttft, *s.gaps]):
            if s.drop_after == i:
                w.transport.abort()
                return False
            if s.error_after == i:
                w.write(_event({"error": {"message": "scripted stream error", "code": 500}}))
                w.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                return True
            await asyncio.sleep(delay)
            last = i == len(s.gaps)
            reason = "length" if last and s.finish else None
            text = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
            w.write(_event({"choices": [{"index": 0, **text, "finish_reason": reason}]}))
        if s.completion_tokens is not None:
            usage = {
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
            }
            w.write(_event({"choices": [], "usage": usage}))
        if s.finish:
            w.write(_chunk(b"data: [DONE]\n\n"))
        w.write(b"0\r\n\r\n")
        return True


@contextmanager
def fake_server_thread(script: Callable[[dict[str, Any]], Script]) -> Iterator[FakeOpenAI]:
    """A FakeOpenAI on a real-time loop in a thread, for tests that go through `main`."""
    loop = asyncio.new_event_loop()
    server = FakeOpenAI(script)
    loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


# The fakes themselves ---------------------------------------------------------------------


def test_virtual_clock_jumps_to_timers_and_stands_still_otherwise() -> None:
    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = [loop.time()]
        await asyncio.sleep(0.25)
        seen.append(loop.time())
        await asyncio.gather(asyncio.sleep(1.0), asyncio.sleep(0.5))
        seen.append(loop.time())
        sum(range(100_000))  # real work takes no virtual time
        seen.append(loop.time())
        return seen

    assert run_virtual(scenario()) == [0.0, 0.25, 1.25, 1.25]


def test_fake_server_streams_on_its_script() -> None:
    import httpx

    async def scenario() -> tuple[list[float], list[str]]:
        server = FakeOpenAI(lambda body: Script(ttft=0.1, gaps=[0.02, 0.03], completion_tokens=3))
        url = await server.start()
        loop = asyncio.get_running_loop()
        times, lines = [], []
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": "m", "prompt": "p", "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line:
                        times.append(loop.time())
                        lines.append(line)
        await server.close()
        return times, lines

    times, lines = run_virtual(scenario())
    assert [round(t, 9) for t in times] == [0.1, 0.12, 0.15, 0.15, 0.15]
    assert lines[-1] == "data: [DONE]" and '"completion_tokens":3' in lines[-2]
