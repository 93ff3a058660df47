"""Supervisor <-> worker messages: start-up, heartbeats, drain, stop, reload, cluster state."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from lmd.protocol.kinds import MsgType, check_name
from lmd.wire import ProtocolError


@dataclass(frozen=True, slots=True)
class Ready:
    """A worker finished starting and serves its role."""

    TYPE: ClassVar[MsgType] = MsgType.READY
    name: str
    pid: int
    info: dict[str, Any]  # role facts shown in status (backend, device, ...)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent every heartbeat_interval; `stats` is what status shows for the worker."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    name: str
    inflight: int  # requests this worker still holds; 0 means a drain may finish
    num_dropped: int  # malformed or unexpected messages dropped since start
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop admitting new requests; finish what is in flight."""

    TYPE: ClassVar[MsgType] = MsgType.DRAIN


@dataclass(frozen=True, slots=True)
class Resume:
    """Admit new requests again after a drain."""

    TYPE: ClassVar[MsgType] = MsgType.RESUME


@dataclass(frozen=True, slots=True)
class Stop:
    """Exit now (after a drain, or when the daemon stops)."""

    TYPE: ClassVar[MsgType] = MsgType.STOP


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """New values of config keys that apply live (lmdctl reload): {key: value}."""

    TYPE: ClassVar[MsgType] = MsgType.RECONFIGURE
    values: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ClusterState:
    """The daemon's view of itself, pushed to every worker when it changes."""

    TYPE: ClassVar[MsgType] = MsgType.CLUSTER_STATE
    state: str  # DaemonState value
    missing_roles: list[str]  # roles with no running worker (why /health is 503)
    # Running workers by name, with each one's pid: a name whose pid changed is a new
    # process, and whatever the old one held (requests, KV reservations) is gone.
    workers: dict[str, int] = dataclasses.field(default_factory=dict)
    # Running workers being retired (lmdctl scale): route nothing new to them.
    draining: list[str] = dataclasses.field(default_factory=list)
    # A cluster's workers on other nodes: name -> their inbox's tcp:// endpoint.
    endpoints: dict[str, str] = dataclasses.field(default_factory=dict)
    # Engines' published load (tokenizer/routing.py): name -> {"queued_tokens",
    # "free_blocks", "total_blocks", "running"}.
    load: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def check(self) -> None:
        for name, pid in self.workers.items():
            check_name("ClusterState", "workers", name)
            if not isinstance(pid, int) or isinstance(pid, bool):
                raise ProtocolError("ClusterState.workers: a pid is not an integer")
        for name, endpoint in self.endpoints.items():
            if name not in self.workers or not str(endpoint).startswith("tcp://"):
                raise ProtocolError(f"ClusterState.endpoints: bad entry for {name[:40]!r}")
