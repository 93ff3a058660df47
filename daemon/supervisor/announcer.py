"""What the supervisor tells its workers about who runs: the ClusterState.

A ClusterState carries the daemon's state, the roles with no running worker (why /health
is 503), the running workers with their pids, those being retired, and the engines'
published load; on a cluster node (`--cluster`) also the other nodes' workers, with the
TCP endpoints of their inboxes (lmd.cluster.node, lmd.cluster.view).

When it goes out:
  1. whenever this node's workers change (ready, died, retiring), or its state does;
  2. within a tick (0.1 s) of another node's record changing in etcd (its lease expired,
     a worker of its restarted);
  3. every heartbeat interval, if the engines' load changed (and a cluster node then
     refreshes its own record in etcd, so that other routers see its load).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from lmd import protocol
from lmd.cluster.view import ClusterView, merge, worker_facts
from lmd.config import ServeConfig
from lmd.protocol.roles import CLUSTER_ROLES, Role
from lmd.supervisor.child import Child
from lmd.supervisor.states import DaemonState

if TYPE_CHECKING:
    from lmd.cluster.node import ClusterNode

log = logging.getLogger(__name__)


class Announcer:
    def __init__(
        self,
        config: ServeConfig,
        pid: int,
        children: Mapping[str, Child],
        state: Callable[[], DaemonState],
        broadcast: Callable[[protocol.Message], Awaitable[None]],
    ) -> None:
        self.heartbeat_interval = config.heartbeat_interval
        self.children = children  # the supervisor's workers, as they change
        self._state = state
        self._broadcast = broadcast
        self.cluster: ClusterNode | None = None  # a cluster node's record in etcd
        if config.cluster is not None:
            from lmd.cluster.node import ClusterNode

            self.cluster = ClusterNode(config, pid)
        self._changed = False  # another node's record changed since the last publish
        self._published_load: dict[str, dict[str, int]] = {}
        self._next_at = 0.0

    async def join(self) -> bool:
        """Register this node in the cluster (a no-op on one host); False: cannot, and
        the reason is logged."""
        if self.cluster is None:
            return True
        from lmd.cluster.membership import MembershipError

        try:
            await self.cluster.join(str(self._state()), worker_facts(self.children.values()))
        except MembershipError as exc:
            log.error("cannot join the cluster: %s", exc)
            return False
        self.cluster.on_change(self._on_change)
        return True

    async def leave(self) -> None:
        if self.cluster is not None:
            await self.cluster.leave()

    def _on_change(self) -> None:
        self._changed = True  # tick() publishes: one ClusterState per tick at most

    @property
    def planned_roles(self) -> list[str]:
        planned = {c.role for c in self.children.values()}
        return [r for r in Role if r in planned]

    def view(self) -> ClusterView:
        """Running workers (a cluster's: on every node), their endpoints and load."""
        state, facts = str(self._state()), worker_facts(self.children.values())
        if self.cluster is None:
            return merge("", state, facts)
        self.cluster.publish(state, facts)
        return self.cluster.view(state, facts)

    async def publish(self) -> None:
        view = self.view()
        required = CLUSTER_ROLES if self.cluster is not None else self.planned_roles
        msg = protocol.ClusterState(
            str(self._state()),
            view.missing(required),
            view.workers,
            view.draining,
            view.endpoints,
            view.load,
        )
        self._published_load = view.load
        await self._broadcast(msg)

    async def tick(self, now: float, stopping: bool) -> bool:
        """Publish what changed since the last tick; True if a ClusterState went out."""
        if not self._changed and now < self._next_at:
            return False
        self._next_at = now + self.heartbeat_interval
        changed, self._changed = self._changed, False
        if stopping or not (changed or self.view().load != self._published_load):
            return False
        await self.publish()
        return True
