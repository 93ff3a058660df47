"""The PUSH channels a worker keeps open to other workers' inboxes, at most MAX_PEERS,
each with a backlog for the messages its peer could not take yet.

A worker sends to another (`Worker.push`) through a channel opened on first use and
kept for the next message. Each is a ZeroMQ socket (a few file descriptors, and libzmq
allows 1023 sockets per context), so the cache is bounded: past MAX_PEERS the least
recently used channel is closed. Names reach it only from the supervisor's cluster view
or from messages whose names the worker checked against it (Worker.knows); the cap holds
even so. A channel whose peer moved (another endpoint: a cluster node's worker restarted
on a new port) is replaced.

A peer that falls behind fills ZeroMQ's queue to it (1,000 messages each side). A
message that does not fit waits in the peer's backlog, and so does every later one
to that peer, so that order is kept; a flusher task sends them as room opens. (They
used to be dropped: a tokenizer 2,000 messages behind a hybrid engine at concurrency
256 lost Tokens, and their requests hung forever.) A message is lost only when it is
over its kind's cap, when the backlog holds MAX_BACKLOG_BYTES already (a peer that
stopped reading for good), or when its channel is closed with the backlog unsent
(evicted, moved, the worker stopping); each is counted in `num_lost`.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from typing import Any

from lmd.ipc import Channel
from lmd.protocol import Message

# Far above the peers one worker talks to (a tokenizer: every engine and api worker of
# the cluster), far below libzmq's 1023 sockets.
MAX_PEERS = 256
# Per peer: some 300,000 Tokens messages of one token; a peer that far behind has stopped.
MAX_BACKLOG_BYTES = 64 << 20
# The flusher's wait for room, doubled while none opens: a peer that is only slow is
# fed within a millisecond, one that is gone costs 20 wake-ups a second.
FLUSH_WAIT_S = (0.001, 0.05)

Watch = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]


class _Peer:
    __slots__ = ("backlog", "backlog_bytes", "channel", "endpoint", "flusher")

    def __init__(self, endpoint: str, channel: Channel) -> None:
        self.endpoint = endpoint
        self.channel = channel
        self.backlog: deque[tuple[list[bytes], int]] = deque()  # (frames, bytes), oldest first
        self.backlog_bytes = 0
        self.flusher: asyncio.Task[None] | None = None


class Peers:
    def __init__(
        self,
        open_channel: Callable[[str, str], Channel],
        watch: Watch,
        cap: int = MAX_PEERS,
        max_backlog_bytes: int = MAX_BACKLOG_BYTES,
    ) -> None:
        """`open_channel(name, endpoint)`: a new PUSH channel to that worker's inbox;
        `watch(work, what)`: runs a flusher as a task (the worker's essential tasks)."""
        self._open = open_channel
        self._watch = watch
        self.cap = cap
        self.max_backlog_bytes = max_backlog_bytes
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # least recently used first
        self.num_evicted = 0  # channels closed to stay under the cap
        self.num_lost = 0  # messages not delivered to ZeroMQ (see the module's doc)
        self.num_held = 0  # messages that waited in a backlog (a peer fell behind)

    def __len__(self) -> int:
        return len(self._peers)

    @property
    def num_waiting(self) -> int:
        """Messages in backlogs, not yet taken by ZeroMQ."""
        return sum(len(peer.backlog) for peer in self._peers.values())

    def send(self, name: str, endpoint: str, msg: Message) -> bool:
        """Send `msg` to worker `name` without waiting; it is sent now or kept in order
        in the peer's backlog. False (counted) when it is lost."""
        peer = self._peer(name, endpoint)
        frames = peer.channel.encode(msg)
        if frames is None:
            self.num_lost += 1
            return False
        if not peer.backlog and peer.channel.try_send_frames(frames):
            return True
        size = sum(len(frame) for frame in frames)
        if peer.backlog_bytes + size > self.max_backlog_bytes:
            self.num_lost += 1
            return False
        peer.backlog.append((frames, size))
        peer.backlog_bytes += size
        self.num_held += 1
        if peer.flusher is None:
            peer.flusher = self._watch(self._flush(peer), f"the flusher to {name}")
        return True

    def channel(self, name: str, endpoint: str) -> Channel:
        """The channel to worker `name` at `endpoint`, opened if need be."""
        return self._peer(name, endpoint).channel

    def _peer(self, name: str, endpoint: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is not None:
            if peer.endpoint == endpoint:
                self._peers.move_to_end(name)
                return peer
            del self._peers[name]
            self._close(peer)
        peer = self._peers[name] = _Peer(endpoint, self._open(name, endpoint))
        if len(self._peers) > self.cap:
            _, oldest = self._peers.popitem(last=False)
            self._close(oldest)
            self.num_evicted += 1
        return peer

    async def _flush(self, peer: _Peer) -> None:
        """Send `peer`'s backlog in order as its queue makes room; ends when it is empty."""
        wait = FLUSH_WAIT_S[0]
        try:
            while peer.backlog:
                await asyncio.sleep(wait)
                sent = 0
                while peer.backlog and peer.channel.try_send_frames(peer.backlog[0][0]):
                    peer.backlog_bytes -= peer.backlog.popleft()[1]
                    sent += 1
                wait = FLUSH_WAIT_S[0] if sent else min(2 * wait, FLUSH_WAIT_S[1])
        finally:
            peer.flusher = None

    def _close(self, peer: _Peer) -> None:
        """Its flusher finds the backlog empty and returns (a cancelled one would count
        as a failed essential task)."""
        self.num_lost += len(peer.backlog)
        peer.backlog.clear()
        peer.backlog_bytes = 0
        peer.channel.close()

    def close(self) -> None:
        """Every channel, as the worker stops."""
        for peer in self._peers.values():
            if peer.flusher is not None:
                peer.flusher.cancel()
            self._close(peer)
        self._peers.clear()
