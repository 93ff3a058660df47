"""The client half of `lmd-bench serve`: streamed OpenAI requests sent on a load schedule.

Life cycle of one request (`send`):
1. Wait for its arrival time (Poisson at --request-rate, else at once), then for a free
   slot when --concurrency caps the number in flight; `start` is read after both.
2. POST the streaming request; a status other than 200 is a failure `http_<status>`.
3. Read server-sent events: each chunk that carries text is timed; an `error` event is a
   failure `stream_error`; `usage` (asked for through stream_options) gives token counts.
4. `[DONE]` or a finish_reason ends it well; a stream that stops before either is
   `incomplete`, a broken connection `dropped`, --timeout `timeout`, refused `connect`.
   A `dropped` request's message says what the socket reported (a reset, an end of
   input), whether the connection was new or reused and whether the response had begun:
   a server that closes an idle connection as the client reuses it, a reset before any
   answer and a stream cut short are told apart.
No failure escapes `send`: the run always finishes and counts it.

The client reads a stream to its `[DONE]`, not to the end of the chunked body, so httpx
closes that connection and the next request opens one: only a non-streamed answer
(/v1/models, /health) leaves a connection to reuse.

Times come from an injected clock (default `time.perf_counter`); tests drive it and the
event loop's sleeps from one virtual clock so that every metric is exact.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from lmd.bench.serve_data import Prompt
from lmd.bench.serve_metrics import RequestResult

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go and what they ask for."""

    url: str  # base, e.g. http://127.0.0.1:23333
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 3600.0
    extra_body: tuple[tuple[str, Any], ...] = ()  # merged into every request body

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: Prompt) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        body |= {
            "max_tokens": prompt.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:  # not OpenAI's: sent only when asked (vLLM, SGLang, LMDeploy, lmd)
            body["ignore_eos"] = True
        return body | dict(self.extra_body)


@dataclass(frozen=True, slots=True)
class Load:
    """How requests arrive: Poisson at `request_rate` (inf: all at once), at most
    `concurrency` in flight (None: no cap)."""

    request_rate: float = math.inf
    concurrency: int | None = None
    seed: int = 0

    def arrivals(self, n: int) -> list[float]:
        """Seconds after the start at which each request may be sent; the first at 0."""
        if math.isinf(self.request_rate):
            return [0.0] * n
        rng = random.Random(self.seed)
        times, t = [], 0.0
        for _ in range(n):
            times.append(t)
            t += rng.expovariate(self.request_rate)
        return times


@dataclass(slots=True)
class Run:
    results: list[RequestResult]
    start: float
    end: float
    client_cpu_cores: list[float] = field(default_factory=list)  # per client process

    @property
    def duration(self) -> float:
        return self.end - self.start


def _fail(result: RequestResult, kind: str, message: str) -> RequestResult:
    result.error, result.error_message = kind, message
    return result


class ConnectionTrace:
    """What became of a request's connection, from httpcore's trace events."""

    def __init__(self) -> None:
        self.new = False  # opened for this request (else reused from the pool)
        self.answered = False  # the response's status line and headers came

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            self.new = True
        elif event == "http11.receive_response_headers.complete":
            self.answered = True

    def dropped(self, exc: Exception) -> str:
        """'ReadError (ConnectionResetError: [Errno 104] ...) on a reused connection,
        before any response'."""
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        cause = exc.__cause__ or exc.__context__
        for _ in range(8):  # httpx's error wraps httpcore's, anyio's, then the socket's
            if cause is None or isinstance(cause, OSError):
                break
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, OSError):
            why += f" ({type(cause).__name__}: {cause})"
        connection = "a new" if self.new else "a reused"
        when = "after the response began" if self.answered else "before any response"
        return f"{why} on {connection} connection, {when}"


def _text(choice: Any, chat: bool) -> str:
    if not isinstance(choice, dict):
        return ""
    if not chat:
        return str(choice.get("text") or "")
    delta = choice.get("delta") or {}
    # Reasoning models stream their thinking apart from the answer: both are output.
    return str(delta.get("content") or "") + str(delta.get("reasoning_content") or "")


def _count(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and value >= 0 else default


async def _read_events(
    response: httpx.Response, result: RequestResult, chat: bool, clock: Clock
) -> RequestResult:
    finished = False
    async for line in response.aiter_lines():
        now = clock()
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            return result
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return _fail(result, "bad_stream", f"not JSON: {data[:200]}")
        if not isinstance(event, dict):
            return _fail(result, "bad_stream", f"not a JSON object: {data[:200]}")
        if event.get("error"):
            return _fail(result, "stream_error", orjson.dumps(event["error"]).decode())
        usage = event.get("usage")
        if isinstance(usage, dict):
            result.prompt_tokens = _count(usage.get("prompt_tokens"), result.prompt_tokens)
            result.completion_tokens = _count(
                usage.get("completion_tokens"), result.completion_tokens
            )
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):  # the prefix cache's hits (lmd, vLLM, OpenAI)
                result.cached_tokens = _count(details.get("cached_tokens"), result.cached_tokens)
        for choice in event.get("choices") or []:
            if _text(choice, chat):
                result.chunk_times.append(now)
            finished = finished or bool(isinstance(choice, dict) and choice.get("finish_reason"))
    if not finished:
        return _fail(result, "incomplete", "the stream ended without [DONE] or a finish_reason")
    return result


async def send(
    client: httpx.AsyncClient, target: Target, prompt: Prompt, clock: Clock = time.perf_counter
) -> RequestResult:
    """One streamed request, timed; failures are recorded in the result, never raised."""
    result = RequestResult(start=clock(), expected_input_len=prompt.input_len)
    body, headers, trace = target.body(prompt), target.headers, ConnectionTrace()
    try:
        async with asyncio.timeout(target.timeout_s):
            async with client.stream(
                "POST", target.endpoint, json=body, headers=headers, extensions={"trace": trace}
            ) as r:
                if r.status_code != 200:
                    text = (await r.aread())[:300].decode(errors="replace")
                    return _fail(result, f"http_{r.status_code}", text)
                return await _read_events(r, result, target.chat, clock)
    except (TimeoutError, httpx.TimeoutException):
        return _fail(result, "timeout", f"no complete answer within {target.timeout_s:g} s")
    except httpx.ConnectError as exc:
        return _fail(result, "connect", str(exc) or type(exc).__name__)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return _fail(result, "dropped", trace.dropped(exc))
    except httpx.HTTPError as exc:
        return _fail(result, "http_error", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a malformed answer must not stop the run: count it, go on
        return _fail(result, "client_error", f"{type(exc).__name__}: {exc}")
    finally:
        result.end = clock()


def http_client(
    target: Target, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    # No cap on connections: a request waiting for a pooled connection would count that
    # wait in its TTFT. Load.concurrency is the only cap.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(
        base_url=target.url,
        timeout=httpx.Timeout(target.timeout_s),
        limits=limits,
        transport=transport,
    )


async def run_load(
    client: httpx.AsyncClient,
    target: Target,
    load: Load,
    prompts: list[Prompt],
    *,
    clock: Clock = time.perf_counter,
    on_done: Callable[[RequestResult], None] | None = None,
) -> Run:
    """Send every prompt on the load's schedule; returns when the last one ended."""
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None

    async def one(prompt: Prompt) -> RequestResult:
        if slots is None:
            result = await send(client, target, prompt, clock)
        else:
            async with slots:
                result = await send(client, target, prompt, clock)
        if on_done is not None:
            on_done(result)
        return result

    start = clock()
    tasks: list[asyncio.Task[RequestResult]] = []
    for prompt, at in zip(prompts, load.arrivals(len(prompts)), strict=True):
        delay = at - (clock() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(prompt)))
    results = list(await asyncio.gather(*tasks))
    end = max((r.end for r in results), default=start)
    return Run(results, start, end)


def models_path(endpoint: str) -> str:
    """/v1/completions or /v1/chat/completions -> /v1/models."""
    base = endpoint.rstrip("/").removesuffix("/completions").removesuffix("/chat")
    return f"{base}/models"


async def first_model(client: httpx.AsyncClient, target: Target) -> str:
    """The first model the server lists; a clear error when it lists none or cannot."""
    path = models_path(target.endpoint)
    try:
        r = await client.get(path, headers=target.headers, timeout=30)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise ValueError(
            f"cannot list models at {target.url}{path} ({reason}): pass --model"
        ) from None
