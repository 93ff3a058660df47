"""The shared half of every worker (lmd.worker), run for real in the test's event loop.

A small role (Echo) answers each TextRequest on the inbox with a RequestError carrying
its prompt, to the request's reply_to; a fake supervisor (a ROUTER on supervisor.ipc)
records what the worker sends it, and a fake api (a PULL on api-0.ipc) the answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
import zmq.asyncio

from lmd import protocol
from lmd.config import ServeConfig
from lmd.protocol import Role
from lmd.roles import WorkerSpec
from lmd.worker import Worker

INTERVAL_S = 0.05  # heartbeat_interval of the workers under test
TIMEOUT_S = 2.0  # their heartbeat_timeout: a supervisor kills a worker silent that long


class Echo(Worker):
    """Answers TextRequest(prompt) with RequestError("echo", prompt) to its reply_to.
    A prompt "raise" makes the handler raise; ClusterState("broken") makes the control
    loop's hook raise."""

    role = Role.TOKENIZER

    def __init__(self, spec: WorkerSpec, config: ServeConfig) -> None:
        super().__init__(spec, config)
        self.stats_failures = 0  # the next role stats() calls that raise

    async def handle(self, msg: protocol.Message) -> bool:
        if not isinstance(msg, protocol.TextRequest):
            return False
        if msg.prompt == "raise":
            raise RuntimeError("a bug in a handler")
        self.push(msg.reply_to, protocol.RequestError(msg.request_id, "echo", msg.prompt or ""))
        return True

    def on_cluster_state(self) -> None:
        if self.cluster_state == "broken":
            raise RuntimeError("a bug in a control hook")

    def stats(self) -> dict[str, Any]:
        if self.stats_failures:
            self.stats_failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return {"echo": 1}


class FlakyProcess:
    """psutil.Process whose next `failures` memory_info() calls fail as /proc reads do
    when the process is out of file descriptors."""

    def __init__(self) -> None:
        self._real = psutil.Process()
        self.failures = 0

    def memory_info(self) -> Any:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self._real.memory_info()

    def cpu_times(self) -> Any:
        return self._real.cpu_times()


class Harness:
    def __init__(self) -> None:
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="lmdw-"))
        config = ServeConfig(
            runtime_dir=self.runtime_dir,
            heartbeat_interval=INTERVAL_S,
            heartbeat_timeout=TIMEOUT_S,
        )
        spec = WorkerSpec("tokenizer-0", Role.TOKENIZER, 0, os.getpid(), config.to_dict())
        self.worker = Echo(spec, config)
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"ipc://{self.runtime_dir}/supervisor.ipc")
        self.api = self.ctx.socket(zmq.PULL)
        self.api.bind(f"ipc://{self.runtime_dir}/api-0.ipc")
        self.to_worker = self.ctx.socket(zmq.PUSH)
        self.to_worker.connect(f"ipc://{self.runtime_dir}/tokenizer-0.ipc")
        self.heartbeats: list[protocol.Heartbeat] = []
        self.ready = asyncio.Event()

    async def start(self) -> None:
        self.run = asyncio.create_task(self.worker.run())
        self._listen = asyncio.create_task(self._supervise())
        await asyncio.wait_for(self.ready.wait(), 10)

    async def _supervise(self) -> None:
        while True:
            _, *frames = await self.router.recv_multipart()
            msg = protocol.decode(frames)
            if isinstance(msg, protocol.Ready):
                self.ready.set()
            elif isinstance(msg, protocol.Heartbeat):
                self.heartbeats.append(msg)

    async def tell(self, msg: protocol.Message) -> None:
        """As the supervisor does: over the worker's control link."""
        await self.router.send_multipart([b"tokenizer-0", *protocol.encode(msg)])

    async def send(self, request_id: str, prompt: str, reply_to: str = "api-0") -> None:
        msg = protocol.TextRequest(request_id, reply_to, None, prompt, {}, [], True, b"")
        # A worker that stopped reading its inbox fills the queue: the send never ends.
        await asyncio.wait_for(self.to_worker.send_multipart(protocol.encode(msg)), 5)

    async def answer(self) -> protocol.RequestError:
        frames = await asyncio.wait_for(self.api.recv_multipart(), 5)
        msg = protocol.decode(frames)
        assert isinstance(msg, protocol.RequestError)
        return msg

    async def beats(self, n: int) -> list[protocol.Heartbeat]:
        """The next n heartbeats; fails as the supervisor would kill the worker: when
        none came for heartbeat_timeout."""
        start = len(self.heartbeats)
        for i in range(n):
            await until(lambda i=i: len(self.heartbeats) > start + i, TIMEOUT_S)  # type: ignore[misc]
        return self.heartbeats[start : start + n]

    async def close(self) -> None:
        if not self.run.done():
            with contextlib.suppress(Exception):
                await self.tell(protocol.Stop())
                await asyncio.wait_for(self.run, 5)
        self.run.cancel()
        self._listen.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._listen
        for sock in (self.router, self.api, self.to_worker):
            sock.close(0)
        self.ctx.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s")


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    await h.start()
    try:
        yield h
    finally:
        await h.close()


async def test_a_handler_that_raises_fails_its_request_and_the_worker_goes_on(
    harness: Harness,
) -> None:
    await harness.send("r1", "raise")
    failed = await harness.answer()
    assert (failed.request_id, failed.code) == ("r1", "internal_error")
    await harness.send("r2", "still here")
    answer = await harness.answer()
    assert (answer.request_id, answer.message) == ("r2", "still here")
    beat = (await harness.beats(1))[0]
    assert beat.num_dropped == 1


async def test_a_dead_control_loop_ends_the_worker_and_its_heartbeat(harness: Harness) -> None:
    await harness.beats(2)
    await harness.tell(protocol.ClusterState("broken", []))
    # The supervisor sees the process exit 1 and restarts it, instead of a heartbeat that
    # goes on while nothing listens.
    assert await asyncio.wait_for(harness.run, 5) == 1
    n = len(harness.heartbeats)
    await asyncio.sleep(5 * INTERVAL_S)
    assert len(harness.heartbeats) == n


async def test_an_essential_task_that_fails_ends_the_worker(harness: Harness) -> None:
    async def step_loop() -> None:
        await asyncio.sleep(2 * INTERVAL_S)
        raise KeyError("a bug in a role's loop")

    harness.worker.watch(step_loop(), "the step loop")
    assert await asyncio.wait_for(harness.run, 5) == 1


@pytest.mark.parametrize("where", ["proc", "stats"])
async def test_the_heartbeat_survives_a_transient_error(harness: Harness, where: str) -> None:
    flaky = FlakyProcess()
    harness.worker._proc = flaky  # type: ignore[assignment]
    before = (await harness.beats(1))[0]
    if where == "proc":
        flaky.failures = 1  # reading /proc/<pid>/statm fails once with EMFILE
    else:
        harness.worker.stats_failures = 1
    beats = await harness.beats(5)  # the supervisor would kill a worker without them
    assert all(b.stats["rss_bytes"] > 0 and b.stats["echo"] == 1 for b in beats)
    assert harness.worker.num_heartbeat_errors == 1
    assert before.stats["rss_bytes"] > 0


async def test_answers_to_a_peer_that_falls_behind_wait_and_arrive_in_order(
    harness: Harness,
) -> None:
    """ZeroMQ holds 1,000 messages each side; the rest used to be dropped (num_lost) and
    their requests hung. The api here reads nothing until all 3,000 are answered."""
    n = 3000
    for i in range(n):
        await harness.send(f"r{i}", "hello")
    await until(lambda: harness.worker._peers.num_waiting > 0)
    answers = [(await harness.answer()).request_id for _ in range(n)]
    assert answers == [f"r{i}" for i in range(n)]
    await until(lambda: harness.worker._peers.num_waiting == 0)
    beat = (await harness.beats(1))[0]
    assert beat.stats["num_lost"] == 0 and beat.stats["num_waiting"] == 0
    assert beat.stats["num_held"] > 0


async def test_names_outside_the_cluster_are_dropped_and_open_no_socket(
    harness: Harness,
) -> None:
    """3,000 distinct reply_to names reached libzmq's 1023 sockets and wedged the tokenizer."""
    await harness.tell(protocol.ClusterState("running", [], {"api-0": 1, "tokenizer-0": 2}))
    for i in range(3000):
        await harness.send(f"g{i}", "hello", reply_to=f"ghost-{i}")
    await harness.send("real", "hello")
    answer = await harness.answer()
    assert answer.request_id == "real"
    assert harness.worker.num_peers == 1  # api-0's
    beat = (await harness.beats(1))[0]
    assert beat.num_dropped == 3000


async def test_a_worker_in_the_cluster_view_is_answered(harness: Harness) -> None:
    """A name the node's plan lacks (another node's api, an added worker) is known once a
    ClusterState lists it, and stays known while it restarts."""
    other = "api-0@b"
    inbox = harness.ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{harness.runtime_dir}/{other}.ipc")
    try:
        await harness.send("before", "hello", reply_to=other)
        await until(lambda: harness.worker.num_dropped == 1)
        await harness.tell(protocol.ClusterState("running", [], {other: 7}))
        await until(lambda: harness.worker.workers == {other: 7})
        await harness.tell(protocol.ClusterState("running", [], {}))  # it restarts
        await until(lambda: harness.worker.workers == {})
        await harness.send("after", "hello", reply_to=other)
        frames = await asyncio.wait_for(inbox.recv_multipart(), 5)
        assert protocol.decode(frames) == protocol.RequestError("after", "echo", "hello")
        assert (await harness.beats(1))[0].num_dropped == 1  # "before"
    finally:
        inbox.close(0)
