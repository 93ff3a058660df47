"""The api worker over real HTTP and real ZeroMQ, with a fake tokenizer and supervisor.

The ApiWorker runs its full `Worker.run` in the test's event loop; a fake supervisor (a
ROUTER on supervisor.ipc) tells it the cluster state, and a fake tokenizer (a PULL on
tokenizer-0.ipc) answers each TextRequest with scripted TextDeltas, so every path of the
front (stream, errors, aborts, auth, limits, metrics) is checked without a model. The
tests are test_api_*.py; their `stack` fixture is in conftest.py.

Fake tokenizer script, by the prompt (or the last chat message):
  "error:CODE"  -> RequestError(CODE)
  "slow"        -> one token every 20 ms until max_tokens or an Abort
  "say:TEXT"    -> TEXT in pieces of 3 characters, finish "stop" (or "length")
  anything else -> the words of REPLY, one delta each, finish "stop"; or "length" at
                   max_tokens. prompt_tokens = number of words (or ids) in the prompt.
Each of a request's n choices says the same, its entries in the same TextDeltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import zmq
import zmq.asyncio
from prometheus_client import values

from lmd import protocol
from lmd.api.metrics import MULTIPROC_DIR
from lmd.api.worker import ApiWorker
from lmd.config import ServeConfig
from lmd.protocol import Role
from lmd.roles import WorkerSpec
from tests.integration.daemon import free_port

MODEL = "SmolLM2-135M-Instruct"
REPLY = ["Paris", " is", " the", " capital", "."]


class FakeTokenizer:
    def __init__(self, ctx: zmq.asyncio.Context, runtime_dir: Path) -> None:
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(f"ipc://{runtime_dir}/tokenizer-0.ipc")
        self.api = ctx.socket(zmq.PUSH)
        self.api.connect(f"ipc://{runtime_dir}/api-0.ipc")
        self.requests: list[protocol.TextRequest] = []
        self.aborted: set[str] = set()
        self.controls: list[protocol.SessionControl] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        while True:
            msg = protocol.decode(await self.inbox.recv_multipart())
            if isinstance(msg, protocol.Abort):
                self.aborted.add(msg.request_id)
            elif isinstance(msg, protocol.SessionControl):
                self.controls.append(msg)
            elif isinstance(msg, protocol.TextRequest):
                self.requests.append(msg)
                task = asyncio.create_task(self._answer(msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _send(self, msg: protocol.Message) -> None:
        await self.api.send_multipart(protocol.encode(msg))

    async def _answer(self, req: protocol.TextRequest) -> None:
        text = req.messages[-1]["content"] if req.messages is not None else req.prompt or ""
        prompt_tokens = len(text.split()) or len(req.prompt_ids) // 4
        if text.startswith("error:"):
            await self._send(protocol.RequestError(req.request_id, text[6:], f"{text[6:]} here"))
            return
        max_tokens = req.sampling.get("max_tokens", 256)
        words = ["tok"] * max_tokens if text == "slow" else REPLY
        if text.startswith("say:"):
            words = [text[i : i + 3] for i in range(4, len(text), 3)]
        n_top = req.sampling.get("logprobs")
        for i, word in enumerate(words[:max_tokens], start=1):
            if req.request_id in self.aborted:
                return
            last = i == min(len(words), max_tokens)
            reason = None if not last else ("length" if i == max_tokens else "stop")
            lps = None
            if n_top is not None:
                raw = list(word.encode())
                top = [[word, -0.25, raw]] * n_top
                lps = [{"token": word, "logprob": -0.25, "bytes": raw, "top": top}]
            n = req.n  # each choice says the same, in one TextDelta
            delta = protocol.TextDelta(
                [req.request_id] * n, [word] * n, [reason] * n, [prompt_tokens] * n,
                [i] * n, [lps] * n, [0] * n, [0] * n, list(range(n)),
            )  # fmt: skip
            await self._send(delta)
            await asyncio.sleep(0.02 if text == "slow" else 0)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.inbox.close(0)
        self.api.close(0)


class FakeSupervisor:
    def __init__(self, ctx: zmq.asyncio.Context, runtime_dir: Path) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"ipc://{runtime_dir}/supervisor.ipc")
        self.ready = asyncio.Event()

    async def run(self) -> None:
        while True:
            _, *frames = await self.router.recv_multipart()
            if isinstance(protocol.decode(frames), protocol.Ready):
                self.ready.set()

    async def send(self, msg: protocol.Message) -> None:
        await self.router.send_multipart([b"api-0", *protocol.encode(msg)])

    def close(self) -> None:
        self.router.close(0)


class Stack:
    """api-0 with its fake peers, and clients for it."""

    def __init__(self, **config: Any) -> None:
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="lmda-"))
        self.config = ServeConfig(runtime_dir=self.runtime_dir, port=free_port(), **config)
        spec = WorkerSpec("api-0", Role.API, 0, os.getpid(), self.config.to_dict())
        self._kept = contextlib.ExitStack()
        self._kept.enter_context(metric_values_kept())  # until close()
        self.worker = ApiWorker(spec, self.config)
        self.ctx = zmq.asyncio.Context()
        self.tokenizer = FakeTokenizer(self.ctx, self.runtime_dir)
        self.supervisor = FakeSupervisor(self.ctx, self.runtime_dir)
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.http = httpx.AsyncClient(base_url=self.url, timeout=10)
        key = config["api_keys"][0] if config.get("api_keys") else "none"
        self.openai = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    async def start(self, running: bool = True) -> None:
        """Start api-0; `running`: then tell it the daemon runs (else it stays starting)."""
        self._tasks = [
            asyncio.create_task(c)
            for c in (self.worker.run(), self.tokenizer.run(), self.supervisor.run())
        ]
        await asyncio.wait_for(self.supervisor.ready.wait(), 10)
        if running:
            await self.tell(protocol.ClusterState("running", []))

    @property
    def worker_task(self) -> asyncio.Task[int | None]:
        """api-0's Worker.run (after start): it ends when the worker stops."""
        return self._tasks[0]

    async def tell(self, state: protocol.ClusterState) -> None:
        """Send api-0 the cluster's state, as the supervisor does; wait till it has it."""
        await self.supervisor.send(state)

        def applied() -> bool:
            w = self.worker
            return (w.cluster_state, w.missing_roles) == (state.state, state.missing_roles)

        await wait_for(applied, "cluster state")

    async def close(self) -> None:
        await self.http.aclose()
        await self.openai.close()
        with contextlib.suppress(Exception):
            await self.supervisor.send(protocol.Stop())
            await asyncio.wait_for(self.worker_task, 10)
        for task in self._tasks:
            task.cancel()
        self.tokenizer.close()
        self.supervisor.close()
        self.ctx.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self._kept.close()


@contextlib.contextmanager
def metric_values_kept() -> Iterator[None]:
    """An ApiWorker built in this process keeps its Prometheus values in files (a choice
    prometheus_client makes per process, api/metrics.py): put back the tests' own."""
    saved, directory = values.ValueClass, os.environ.get(MULTIPROC_DIR)
    try:
        yield
    finally:
        values.ValueClass = saved
        if directory is None:
            os.environ.pop(MULTIPROC_DIR, None)
        else:
            os.environ[MULTIPROC_DIR] = directory


async def wait_for(predicate: Any, what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def chat_body(content: str = "What is the capital of France?", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param and param in err["message"]
    return err
