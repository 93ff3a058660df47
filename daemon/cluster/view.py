"""The cluster as one node's workers see it: its own workers and every other node's,
merged into what a ClusterState carries. Pure: no I/O.

Each node describes its workers as `facts` (`worker_facts`): role, pid, state, the TCP
endpoint of its inbox, whether it is being retired, and the load it last published.
A node's supervisor merges its own facts with the records of the other nodes that
membership (etcd) holds: running workers anywhere are routable; those of a node that
drains or stops, or being retired, are listed as draining (nothing new goes to them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from lmd.names import role_of
from lmd.protocol.roles import ENGINE_ROLES

ROUTABLE_NODE_STATES = ("running",)


class WorkerLike(Protocol):
    """What worker_facts reads of a supervisor's Child."""

    retiring: bool
    info: dict[str, Any]
    stats: dict[str, Any]

    @property
    def name(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def state(self) -> Any: ...


class RecordLike(Protocol):
    """What merge reads of another node's membership record."""

    @property
    def node(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def workers(self) -> dict[str, dict[str, Any]]: ...


@dataclass(slots=True)
class ClusterView:
    workers: dict[str, int] = field(default_factory=dict)  # running: name -> pid
    draining: list[str] = field(default_factory=list)  # of those, route nothing new
    endpoints: dict[str, str] = field(default_factory=dict)  # other nodes': tcp:// inbox
    load: dict[str, dict[str, int]] = field(default_factory=dict)  # engines' load

    def missing(self, required: Iterable[str]) -> list[str]:
        """Roles of `required` with no running worker anywhere."""
        up = {role_of(n) for n in self.workers}
        return [r for r in required if r not in up]


def load_of(stats: Mapping[str, Any]) -> dict[str, int] | None:
    """An engine's load from its heartbeat stats; None before its first heartbeat."""
    kv = stats.get("kv")
    if not isinstance(kv, dict):
        return None
    return {
        "queued_tokens": int(stats.get("queued_tokens", 0)),
        "free_blocks": int(kv.get("free_blocks", 0)),
        "total_blocks": int(kv.get("total_blocks", 0)),
        # sequences in the engine, running or waiting for a place (routing.Router.pressure)
        "running": int(stats.get("running", 0)) + int(stats.get("waiting", 0)),
    }


def worker_facts(children: Iterable[WorkerLike]) -> dict[str, dict[str, Any]]:
    """What a node says of each of its workers (its membership record, and merge)."""
    out: dict[str, dict[str, Any]] = {}
    for child in children:
        facts: dict[str, Any] = {"role": child.role, "pid": child.pid, "state": str(child.state)}
        if child.retiring:
            facts["retiring"] = True
        if endpoint := child.info.get("endpoint"):
            facts["endpoint"] = endpoint
        if device := child.info.get("device"):
            facts["device"] = device
        if child.role in ENGINE_ROLES and (load := load_of(child.stats)) is not None:
            facts["load"] = load
            facts["total_blocks"] = int(child.stats["kv"].get("total_blocks", 0))  # capacity
        out[child.name] = facts
    return out


def merge(
    own_node: str,
    own_state: str,
    own: Mapping[str, Mapping[str, Any]],
    others: Iterable[RecordLike] = (),
) -> ClusterView:
    """This node's workers (`own`, from worker_facts) and the other nodes' records."""
    view = ClusterView()
    _add(view, own_state, own, remote=False)
    for record in others:
        if record.node != own_node:
            _add(view, record.state, record.workers, remote=True)
    return view


def _add(
    view: ClusterView,
    node_state: str,
    workers: Mapping[str, Mapping[str, Any]],
    remote: bool,
) -> None:
    for name, facts in workers.items():
        pid = facts.get("pid")
        if facts.get("state") != "running" or not isinstance(pid, int):
            continue
        if remote and not isinstance(facts.get("endpoint"), str):
            continue  # another node's worker we could not reach
        view.workers[name] = pid
        if remote:
            view.endpoints[name] = facts["endpoint"]
        # A node's own draining (lmdctl drain) is its workers' business: they refuse
        # new work themselves. Another node's draining or stopping keeps ours away.
        node_closed = remote and node_state not in ROUTABLE_NODE_STATES
        if facts.get("retiring") or node_closed:
            view.draining.append(name)
        load = facts.get("load")
        if isinstance(load, dict):
            view.load[name] = {k: int(v) for k, v in load.items() if isinstance(v, int)}
