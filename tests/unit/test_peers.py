"""The bounded cache of PUSH channels to other workers (lmd.peers), over real sockets."""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.asyncio

from lmd import ipc
from lmd.peers import MAX_PEERS, Peers


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

    peers = Peers(open_channel)
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
    peers = Peers(lambda name, endpoint: ipc.connect_push(ctx, endpoint, name), cap=2)
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
