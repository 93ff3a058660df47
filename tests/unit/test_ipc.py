"""Typed channels over real ZeroMQ sockets: full queues, floods, size caps."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from lmd import ipc, protocol


async def test_try_send_says_false_when_the_peer_is_not_reading(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    try:
        channel = ipc.connect_push(ctx, f"ipc://{tmp_path}/nobody.ipc", "test")
        channel.socket.setsockopt(zmq.SNDHWM, 2)
        results = [channel.try_send(protocol.Abort(f"r{i}")) for i in range(10)]
        assert results[0] is True
        assert results.count(False) >= 5  # queued up to the high-water mark, then refused
        channel.close()
    finally:
        ctx.term()


async def test_a_flood_of_waiting_messages_lets_the_event_loop_run(tmp_path: Path) -> None:
    """A receive that finds a message waiting returns without yielding: 500k messages
    in the api's inbox held its heartbeat and /health for 14 s."""
    ctx = zmq.asyncio.Context()
    sender = zmq.Context()
    endpoint = f"ipc://{tmp_path}/inbox.ipc"
    inbox = ipc.bind_pull(ctx, endpoint, "inbox")
    push = sender.socket(zmq.PUSH)
    push.connect(endpoint)
    n = 900  # under the high-water marks: all of them wait in the inbox
    try:
        frames = protocol.encode(protocol.Abort("r"))
        for _ in range(n):
            push.send_multipart(frames)
        await inbox.socket.poll(5000)  # the first one is there
        await asyncio.sleep(0.2)  # and the rest
        turns = 0

        async def other_task() -> None:  # a heartbeat, an HTTP request
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other_task())
        await asyncio.sleep(0)
        start = turns
        for _ in range(n):
            await inbox.recv()
        during = turns - start
        task.cancel()
        assert during >= 10  # once every ipc.RECV_BATCH (64) messages; it was never
    finally:
        push.close(0)
        sender.term()
        inbox.close()
        ctx.term()


@dataclass
class Inbox:
    """An inbox channel bound in the test's loop, and a raw PUSH socket connected to it."""

    ctx: zmq.asyncio.Context
    endpoint: str
    channel: ipc.Channel
    push: zmq.asyncio.Socket


@pytest.fixture
def inbox(tmp_path: Path) -> Iterator[Inbox]:
    ctx = zmq.asyncio.Context()
    endpoint = f"ipc://{tmp_path}/inbox.ipc"
    channel = ipc.bind_pull(ctx, endpoint, "inbox")
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    try:
        yield Inbox(ctx, endpoint, channel, push)
    finally:
        push.close(0)
        channel.close()
        ctx.term()


async def test_a_message_over_its_cap_is_dropped_and_the_next_one_taken(inbox: Inbox) -> None:
    text = "x" * (8 << 20)  # TextDelta's cap is 8 MiB, all frames together
    big = protocol.TextDelta(["r"], [text], [None], [1], [1], [None], [0], [0], [0])
    await inbox.push.send_multipart(protocol.encode(big))
    await inbox.push.send_multipart(protocol.encode(protocol.Abort("next")))
    assert await asyncio.wait_for(inbox.channel.recv(), 5) == protocol.Abort("next")
    assert inbox.channel.num_dropped == 1
    # A sender refuses it: the request fails where it starts, not silently later.
    out = ipc.connect_push(inbox.ctx, inbox.endpoint, "out")
    assert out.try_send(big) is False and out.num_oversize == 1
    assert out.try_send(protocol.Abort("small")) is True
    assert await asyncio.wait_for(inbox.channel.recv(), 5) == protocol.Abort("small")
    out.close()


async def test_a_frame_over_every_cap_is_not_taken_in(inbox: Inbox) -> None:
    """ZMQ_MAXMSGSIZE: libzmq drops the connection instead of buffering the frame."""
    await inbox.push.send_multipart([b"\x19", bytes((64 << 20) + 1)])  # MAX_FRAME_BYTES + 1
    await asyncio.sleep(0.5)  # the peer reconnects
    await inbox.push.send_multipart(protocol.encode(protocol.Abort("after")))
    assert await asyncio.wait_for(inbox.channel.recv(), 5) == protocol.Abort("after")
    assert inbox.channel.num_dropped == 0  # never reached the decoder
