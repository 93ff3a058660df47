"""A cluster node's supervisor side: its record in etcd, and the cluster it sees.

Life cycle of a node (`lmdd serve --cluster etcd://HOST:PORT --node-name N`):
  1. `join`: before any worker starts, the supervisor registers the node under a lease
     (Membership): a node name another live supervisor holds, an unreachable etcd or an
     unreadable key file stops the daemon with a one-line reason.
  2. Running: whenever its workers change, and every heartbeat interval for their
     load, the node `publish`es its record (its state and each worker's facts:
     role, pid, state, TCP endpoint, load), signed with the cluster key. Membership's
     watch tells the supervisor when another node's record changes or its lease
     expires (a dead host: gone within the lease TTL); the supervisor then pushes a new
     ClusterState (`view`) to its workers, which route to and fail over by it.
  3. `leave`: the lease is revoked, and the other nodes drop our workers at once.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lmd.cluster.keys import ClusterKey
from lmd.cluster.membership import Membership, NodeRecord, parse_etcd_url
from lmd.cluster.view import ClusterView, merge
from lmd.config import ServeConfig

log = logging.getLogger(__name__)


def route_address(url: str) -> str:
    """This host's address on the route to etcd: what other nodes most likely reach."""
    host, port = parse_etcd_url(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: picks the route, sends nothing
        return str(s.getsockname()[0])


class ClusterNode:
    def __init__(self, config: ServeConfig, pid: int) -> None:
        assert config.cluster is not None and config.cluster_key is not None
        self.config = config
        self.node = config.node
        self.pid = pid
        key = ClusterKey.load(Path(config.cluster_key))
        ttl_s = max(3.0, 3 * config.heartbeat_interval)
        self.membership = Membership(config.cluster, self.node, key.mac_key, ttl_s=ttl_s)

    async def join(self, state: str, facts: Mapping[str, Mapping[str, Any]]) -> None:
        """Register this node; raises MembershipError with the reason it cannot."""
        await self.membership.start(self._record(state, facts))
        log.info(
            "joined the cluster at %s as node %s (%s)",
            self.config.cluster,
            self.node,
            self.config.advertise_host,
        )

    def on_change(self, callback: Callable[[], None]) -> None:
        self.membership.on_change(callback)

    def publish(self, state: str, facts: Mapping[str, Mapping[str, Any]]) -> None:
        self.membership.publish(self._record(state, facts))

    def view(self, state: str, facts: Mapping[str, Mapping[str, Any]]) -> ClusterView:
        return merge(self.node, state, facts, self.membership.view.values())

    async def leave(self) -> None:
        await self.membership.stop()

    def status(self) -> dict[str, Any]:
        """The whole cluster, as `lmdctl status` shows it."""
        nodes = []
        for name, record in sorted(self.membership.view.items()):
            workers = [{"name": w, **facts} for w, facts in sorted(record.workers.items())]
            nodes.append(
                {
                    "node": name,
                    "host": record.host,
                    "pid": record.pid,
                    "state": record.state,
                    "workers": workers,
                }
            )
        return {
            "etcd": self.config.cluster,
            "node": self.node,
            "connected": self.membership.connected,
            "nodes": nodes,
        }

    def _record(self, state: str, facts: Mapping[str, Mapping[str, Any]]) -> NodeRecord:
        return NodeRecord(
            node=self.node,
            host=self.config.advertise_host or "",
            pid=self.pid,
            state=state,
            workers={name: dict(f) for name, f in facts.items()},
        )
