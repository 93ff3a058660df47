"""The bounded cache of PUSH channels to other workers and their backlogs (lmd.peers),
over real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from lmd import ipc, protocol
from lmd.peers import MAX_PEERS, Peers

HWM = 10  # each side's ZeroMQ queue in the backlog tests: 2 x HWM messages fit


class Flushers:
    """Peers' `watch`: runs each flusher as a task and keeps what became of it."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    def __call__(self, work: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self.tasks.append(task)
        return task

    async def ended_cleanly(self) -> bool:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 5)
        return all(not t.cancelled() and t.exception() is None for t in self.tasks)


def closed(channel: ipc.Channel) -> bool:
    return bool(channel.socket.closed)


async def test_three_thousand_peers_keep_at_most_the_cap_open(tmp_path: Path) -> None:
    """A socket per name ever seen reached libzmq's 1023 sockets and wedged the tokenizer."""
    ctx = zmq.asyncio.Context()
    opened: list[ipc.Channel] = []

    def open_channel(name: str, endpoint: str) -> ipc.Channel:
        channel = ipc.connect_push(ctx, endpoint, name)
        opened.append(channel)
        return channel

    peers = Peers(open_channel, Flushers())
    try:
        for i in range(3000):
            peers.channel(f"api-{i}", f"ipc://{tmp_path}/api-{i}.ipc")
        assert len(peers) == MAX_PEERS
        assert sum(not closed(c) for c in opened) == MAX_PEERS
        assert peers.num_evicted == 3000 - MAX_PEERS
    finally:
        peers.close()
        ctx.term()


async def test_the_least_recently_used_goes_first_and_a_moved_peer_is_reopened(
    tmp_path: Path,
) -> None:
    ctx = zmq.asyncio.Context()
    peers = Peers(lambda name, endpoint: ipc.connect_push(ctx, endpoint, name), Flushers(), cap=2)
    try:
        a = peers.channel("a", f"ipc://{tmp_path}/a.ipc")
        b = peers.channel("b", f"ipc://{tmp_path}/b.ipc")
        assert peers.channel("a", f"ipc://{tmp_path}/a.ipc") is a  # a is used again
        peers.channel("c", f"ipc://{tmp_path}/c.ipc")
        assert closed(b) and not closed(a)
        moved = peers.channel("a", "ipc://elsewhere/a.ipc")  # a restarted elsewhere
        assert moved is not a and closed(a) and len(peers) == 2
    finally:
        peers.close()
        ctx.term()


def small_queues(ctx: zmq.asyncio.Context) -> Any:
    def open_channel(name: str, endpoint: str) -> ipc.Channel:
        channel = ipc.Channel(ctx.socket(zmq.PUSH), name)
        channel.socket.setsockopt(zmq.SNDHWM, HWM)
        channel.socket.connect(endpoint)
        return channel

    return open_channel


def slow_inbox(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, HWM)
    inbox.bind(endpoint)
    return inbox


async def test_a_peer_that_falls_behind_gets_every_message_in_order(tmp_path: Path) -> None:
    """A tokenizer 2,000 messages behind a hybrid engine lost Tokens (ZeroMQ's queue was
    full) and their requests hung: now they wait in the backlog and arrive in order."""
    ctx = zmq.asyncio.Context()
    endpoint = f"ipc://{tmp_path}/tokenizer-0.ipc"
    inbox = slow_inbox(ctx, endpoint)
    flushers = Flushers()
    peers = Peers(small_queues(ctx), flushers)
    n = 50 * HWM
    try:
        sent = [peers.send("tokenizer-0", endpoint, protocol.Abort(f"r{i}")) for i in range(n)]
        assert all(sent) and peers.num_lost == 0
        assert peers.num_waiting >= n - 2 * HWM  # the peer read nothing yet
        got = [protocol.decode(await asyncio.wait_for(inbox.recv_multipart(), 5)) for _ in range(n)]
        assert got == [protocol.Abort(f"r{i}") for i in range(n)]
        assert peers.num_waiting == 0 and await flushers.ended_cleanly()
        assert peers.send("tokenizer-0", endpoint, protocol.Abort("after"))
        got_after = protocol.decode(await asyncio.wait_for(inbox.recv_multipart(), 5))
        assert got_after == protocol.Abort("after") and peers.num_waiting == 0
    finally:
        peers.close()
        inbox.close(0)
        ctx.term()


async def test_a_backlog_is_bounded_and_a_closed_one_is_counted_lost(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    flushers = Flushers()
    one = len(b"".join(protocol.encode(protocol.Abort("r00"))))
    peers = Peers(small_queues(ctx), flushers, cap=1, max_backlog_bytes=5 * one)
    gone = f"ipc://{tmp_path}/gone.ipc"  # nobody reads: ZeroMQ queues HWM, then the backlog
    try:
        sent = [peers.send("gone", gone, protocol.Abort(f"r{i:02}")) for i in range(HWM + 8)]
        assert sent == [True] * (HWM + 5) + [False] * 3
        assert peers.num_lost == 3 and peers.num_waiting == 5
        peers.channel("other", f"ipc://{tmp_path}/other.ipc")  # evicts "gone" (cap 1)
        assert peers.num_lost == 8 and peers.num_waiting == 0
        assert await flushers.ended_cleanly()  # returned, not failed: the worker goes on
    finally:
        peers.close()
        ctx.term()
