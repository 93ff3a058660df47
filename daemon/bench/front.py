"""`lmd-bench front`: what the serving path costs without the model.

    lmd-bench front [--engine fixed|fake] [--requests 2000] [--concurrency 64]
                    [--stream-tokens 64] [--temperature 0] [--torch-threads 1] [--json]

Starts a daemon in hybrid mode whose engine worker computes nothing, then measures the
real api, tokenizer and wire protocol through HTTP on loopback. `--engine fixed` (the
default, the front issue's "fake engine, a worker that returns fixed tokens at once"):
the worker runs `FixedTokenEngine`, which gives every running request its next token at
each step, with no scheduler, sampler or KV. `--engine fake`: the real engine (schedulers,
sampler, block manager) around the `fake` backend, a model that computes nothing; the
engine's own per-token cost is then in the figures too. Measured:
- non-streaming `/v1/completions` with max_tokens=1 at --concurrency: requests per second;
- the same one at a time: p50/p99 latency, i.e. what the front adds to every request;
- streaming with --stream-tokens tokens each at --concurrency: streamed tokens per second;
- for both loads, the CPU time each process used per request or per streamed token, which
  holds when other work shares the cores (requests per second does not);
- how many tokens a stream's HTTP chunk carried on average: the api writes every event
  it has for a stream at once, so a busy api writes less often, and its CPU per token
  depends on this.
The client (`http_client.Connection`, one keep-alive connection per concurrent worker, on
uvloop) costs far less per request than the server, so that it does not bound the figures
on the cores it shares with the daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import psutil
import uvloop

from lmd.bench.http_client import Connection, HttpError

HOST = "127.0.0.1"
# ignore_eos: the measures count tokens, and at a temperature above 0 the fake engine's
# logits (a 1 among 49,152 zeros) make every token about as likely as the next, EOS
# among them (~2e-5 a token): without it ~1% of runs had a request end early and
# counted as failed.
MODEL_FIELDS = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello there", "ignore_eos": True}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("front", help="the serving path's own cost, with a model-less engine")
    p.add_argument(
        "--engine",
        choices=("fixed", "fake"),
        default="fixed",
        help="fixed: no engine, fixed tokens at once; fake: the real engine, no model",
    )
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads (OMP_NUM_THREADS) in the daemon; 0: torch's default",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; above: the sampled path"
    )
    p.add_argument("--port", type=int, default=0, help="default: a free port")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(run=run)


Unit = Callable[[Connection], Awaitable[int]]
C = TypeVar("C")


async def _load(
    n: int, concurrency: int, one: Unit, port: int
) -> tuple[float, list[float], int, int]:
    """Run `one` n times over `concurrency` connections: (seconds, latencies, units, failures)."""
    conns = [await Connection.open(HOST, port) for _ in range(concurrency)]
    try:
        return await _drive(n, conns, one)
    finally:
        for conn in conns:
            conn.close()


async def _drive(
    n: int, conns: Sequence[C], one: Callable[[C], Awaitable[int]]
) -> tuple[float, list[float], int, int]:
    """Run `one` n times, one worker per connection at once."""
    queue = iter(range(n))
    latencies: list[float] = []
    totals = [0, 0]  # units (requests or tokens), failures

    async def worker(conn: C) -> None:
        for _ in queue:
            t0 = time.perf_counter()
            try:
                # Not `totals[0] += await ...`: that reads totals[0] before the await and
                # overwrites what the other workers added meanwhile.
                units = await one(conn)
            except (HttpError, ValueError, KeyError):
                totals[1] += 1
                continue
            totals[0] += units
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker(conn) for conn in conns))
    return time.perf_counter() - start, latencies, totals[0], totals[1]


def _requester(temperature: float) -> Unit:
    body = {**MODEL_FIELDS, "temperature": temperature, "max_tokens": 1}
    request = Connection.post_request(HOST, "/v1/completions", orjson.dumps(body))

    async def one(conn: Connection) -> int:
        body = orjson.loads(await conn.send(request))
        if body["usage"]["completion_tokens"] != 1:
            raise ValueError(f"answered {body['usage']['completion_tokens']} tokens, not 1")
        return 1

    return one


def _streamer(tokens: int, temperature: float, chunks: list[int] | None = None) -> Unit:
    """Streams `tokens` each; `chunks` counts the HTTP chunks (the api's writes) and the
    SSE `data: {...}` events that carried text (the usage-only one left out)."""
    counted = chunks if chunks is not None else [0, 0]
    body = {
        **MODEL_FIELDS,
        "temperature": temperature,
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = Connection.post_request(HOST, "/v1/completions", orjson.dumps(body))

    async def one(conn: Connection) -> int:
        usage = 0
        pending = b""
        async for piece in conn.stream(request):
            counted[0] += 1
            pending += piece
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                # Only the last chunk (include_usage) has a usage object.
                if b'"usage":{' in event:
                    usage = orjson.loads(event[6:])["usage"]["completion_tokens"]
                else:
                    counted[1] += 1
        if usage != tokens:
            raise ValueError(f"streamed {usage} tokens, not {tokens}")
        return usage

    return one


def _ms(values: list[float], q: int) -> float:
    return round(statistics.quantiles(values, n=100)[q - 1] * 1000, 2) if len(values) > 1 else 0.0


class CpuMeter:
    """CPU seconds (user + system) used by each daemon process and by this client.

    Figures per request or per token from these hold even when other work shares the
    cores, unlike requests per second.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self._procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self._procs["client"] = psutil.Process()

    def read(self) -> dict[str, float]:
        return {name: _cpu_seconds(proc) for name, proc in self._procs.items()}

    def per_unit(self, before: dict[str, float], units: int, scale: float) -> dict[str, float]:
        """CPU used since `before`, per unit, times `scale` (1e3: ms, 1e6: us)."""
        used = {name: secs - before[name] for name, secs in self.read().items()}
        used["daemon"] = sum(v for name, v in used.items() if name != "client")
        return {name: round(v * scale / max(units, 1), 3) for name, v in used.items()}


def _cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


async def _measure(port: int, args: argparse.Namespace, cpu: CpuMeter) -> dict[str, Any]:
    one_request = _requester(args.temperature)
    await _load(50, 8, one_request, port)  # warm-up
    before = cpu.read()
    secs, _, done, failed = await _load(args.requests, args.concurrency, one_request, port)
    cpu_request = cpu.per_unit(before, done, 1e3)
    _, lat, _, failed_1 = await _load(min(500, args.requests), 1, one_request, port)
    n_stream = max(1, args.requests // 4)
    before = cpu.read()
    chunks = [0, 0]
    s_secs, _, tokens, s_failed = await _load(
        n_stream, args.concurrency, _streamer(args.stream_tokens, args.temperature, chunks), port
    )
    cpu_token = cpu.per_unit(before, tokens, 1e6)
    return {
        "benchmark": "front",
        "engine": args.engine,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "temperature": args.temperature,
        "requests_per_s": round(done / secs, 1),
        "cpu_ms_per_request": cpu_request,
        "latency_ms_at_concurrency_1": {"p50": _ms(lat, 50), "p99": _ms(lat, 99)},
        "stream_requests": n_stream,
        "stream_tokens_each": args.stream_tokens,
        "streamed_tokens_per_s": round(tokens / s_secs, 1),
        "stream_tokens_per_write": round(tokens / max(chunks[0], 1), 2),
        "stream_tokens_per_event": round(tokens / max(chunks[1], 1), 2),
        "cpu_us_per_streamed_token": cpu_token,
        "failed": failed + failed_1 + s_failed,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.requests < 2 or args.concurrency < 1 or args.stream_tokens < 1:
        raise ValueError("--requests must be >= 2, --concurrency and --stream-tokens >= 1")
    if args.temperature < 0 or args.torch_threads < 0:
        raise ValueError("--temperature and --torch-threads must be >= 0")
    runtime = Path(tempfile.mkdtemp(prefix="lmdb-"))
    port = args.port or _free_port()
    cmd = [
        sys.executable,
        "-m",
        "lmd",
        "serve",
        "--mode",
        "hybrid",
        "--decode-backend",
        args.engine,
        "--port",
        str(port),
        "--runtime-dir",
        str(runtime),
        "--log-level",
        "warning",
        "--cache-max-entry-count",
        "256",
        "--max-batch-size",
        "256",
    ]
    log_path = runtime.parent / f"{runtime.name}.log"
    with open(log_path, "wb") as log:
        env = dict(os.environ)
        # The fake engine's tensors are small: a second OpenMP thread gains nothing and,
        # on cores shared with the api and tokenizer, made a decode step many times slower
        # (docs/benchmarks.md, 'Sampler, stream writes, one torch thread, CPU per unit').
        if args.torch_threads:
            env["OMP_NUM_THREADS"] = str(args.torch_threads)
        daemon = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, daemon, log_path)
        cpu = CpuMeter({"supervisor": daemon.pid, **_worker_pids(runtime)})
        return uvloop.run(_measure(port, args, cpu))
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        os.unlink(log_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_pids(runtime: Path) -> dict[str, int]:
    """Worker name -> pid, from the daemon's control socket."""
    transport = httpx.HTTPTransport(uds=str(runtime / "control.sock"))
    with httpx.Client(transport=transport, base_url="http://lmd", timeout=10) as client:
        workers = client.get("/v1/workers").json()["workers"]
    return {str(w["name"]): int(w["pid"]) for w in workers}


def _wait_healthy(url: str, daemon: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise ValueError(f"the daemon exited ({daemon.returncode}): see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise ValueError("the daemon did not become healthy in 300 s")


def summary(result: dict[str, Any]) -> str:
    lat = result["latency_ms_at_concurrency_1"]
    return (
        f"engine: {result['engine']}\n"
        f"non-streaming: {result['requests_per_s']:,} requests/s at concurrency "
        f"{result['concurrency']} ({result['requests']:,} requests)\n"
        f"one at a time: p50 {lat['p50']} ms, p99 {lat['p99']} ms per request\n"
        f"streaming: {result['streamed_tokens_per_s']:,} tokens/s "
        f"({result['stream_requests']:,} x {result['stream_tokens_each']} tokens, "
        f"{result['stream_tokens_per_write']} tokens per write, "
        f"{result['stream_tokens_per_event']} per SSE event)\n"
        f"CPU ms per request: {_cpu_line(result['cpu_ms_per_request'])}\n"
        f"CPU us per streamed token: {_cpu_line(result['cpu_us_per_streamed_token'])}\n"
        f"failed: {result['failed']}"
    )


def _cpu_line(per_process: dict[str, float]) -> str:
    return ", ".join(f"{name} {value}" for name, value in per_process.items())
