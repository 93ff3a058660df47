"""The PUSH channels a worker keeps open to other workers' inboxes, at most MAX_PEERS.

A worker sends to another (`Worker.push`) through a channel opened on first use and
kept for the next message. Each is a ZeroMQ socket (a few file descriptors, and libzmq
allows 1023 sockets per context), so the cache is bounded: past MAX_PEERS the least
recently used channel is closed. Names reach it only from the supervisor's cluster view
or from messages whose names the worker checked against it (Worker.knows); the cap holds
even so. A channel whose peer moved (another endpoint: a cluster node's worker restarted
on a new port) is replaced.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from lmd.ipc import Channel

# Far above the peers one worker talks to (a tokenizer: every engine and api worker of
# the cluster), far below libzmq's 1023 sockets.
MAX_PEERS = 256


class Peers:
    def __init__(self, open_channel: Callable[[str, str], Channel], cap: int = MAX_PEERS) -> None:
        """`open_channel(name, endpoint)`: a new PUSH channel to that worker's inbox."""
        self._open = open_channel
        self.cap = cap
        self._channels: OrderedDict[str, tuple[str, Channel]] = OrderedDict()  # LRU first
        self.num_evicted = 0  # channels closed to stay under the cap

    def __len__(self) -> int:
        return len(self._channels)

    def channel(self, name: str, endpoint: str) -> Channel:
        """The channel to worker `name` at `endpoint`, opened if need be."""
        entry = self._channels.get(name)
        if entry is not None:
            known, channel = entry
            if known == endpoint:
                self._channels.move_to_end(name)
                return channel
            del self._channels[name]
            channel.close()
        channel = self._open(name, endpoint)
        self._channels[name] = (endpoint, channel)
        if len(self._channels) > self.cap:
            _, (_, oldest) = self._channels.popitem(last=False)
            oldest.close()
            self.num_evicted += 1
        return channel

    def close(self) -> None:
        for _, channel in self._channels.values():
            channel.close()
        self._channels.clear()
