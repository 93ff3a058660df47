"""`lmdctl scale ROLE N`: add or remove prefill/decode workers while the daemon serves.

Adding: new workers (the lowest free indices) are spawned as at start-up; once Ready,
ClusterState lists them and the tokenizer routes to them.
Removing: the highest-index workers of the role retire. ClusterState names them in
`draining`, so the tokenizer routes nothing new to them, while they stay in `workers`,
so nothing they hold is failed. After a grace period (messages routed before the
tokenizer heard of it still arrive), a retiring worker is stopped once a heartbeat says
it holds no request, or when drain_timeout runs out (what it still holds then fails
with an error, as for a worker that died). A retired worker that exits is forgotten,
not restarted.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from lmd import protocol
from lmd.names import worker_name
from lmd.supervisor.child import Child
from lmd.supervisor.control import ControlError
from lmd.supervisor.states import DaemonState, WorkerState
from lmd.worker import WorkerSpec

if TYPE_CHECKING:
    from lmd.supervisor.supervisor import Supervisor

log = logging.getLogger(__name__)

SCALABLE_ROLES = ("prefill", "decode")
MAX_WORKERS = 64


def grace_s(sup: Supervisor) -> float:
    """How long after a retirement began the worker may still receive routed work."""
    return 2 * sup.config.heartbeat_interval + 1.0


async def scale(sup: Supervisor, role: str, count: int) -> dict[str, Any]:
    if role not in SCALABLE_ROLES:
        raise ControlError(400, "bad_role", f"{role!r} cannot scale; use prefill or decode")
    if sup.config.mode != "disaggregated":
        raise ControlError(409, "hybrid_mode", "scaling needs --mode disaggregated")
    if not 1 <= count <= MAX_WORKERS:
        raise ControlError(400, "bad_count", f"{count} is out of range (1-{MAX_WORKERS})")
    if sup.state != DaemonState.RUNNING:
        raise ControlError(409, str(sup.state), f"the daemon is {sup.state}; try later")
    serving = sorted(
        (c for c in sup.children.values() if c.role == role and not c.retiring),
        key=lambda c: c.spec.index,
    )
    added: list[str] = []
    retiring: list[str] = []
    if count > len(serving):
        used = {c.spec.index for c in sup.children.values() if c.role == role}
        index = 0
        while len(serving) + len(added) < count:
            while index in used:
                index += 1
            used.add(index)
            added.append(_spawn(sup, role, index))
    for child in serving[count:]:
        child.retiring = True
        child.retire_started = time.monotonic()
        retiring.append(child.name)
    if added or retiring:
        log.info(
            "scale %s to %d: adding %s; retiring %s",
            role,
            count,
            ", ".join(added) or "none",
            ", ".join(retiring) or "none",
        )
        await sup.publish_cluster_state()
    return {"role": role, "count": count, "added": added, "retiring": retiring}


def _spawn(sup: Supervisor, role: str, index: int) -> str:
    backend = sup.config.prefill_backend if role == "prefill" else sup.config.decode_backend
    spec = WorkerSpec(
        name=worker_name(role, index, sup.config.node),
        role=role,
        index=index,
        supervisor_pid=sup.pid,
        config=sup.config.to_dict(),
        backend=backend,
        device=sup.config.role_device(role, sup.device),
    )
    child = Child(spec)
    sup.children[spec.name] = child
    child.spawn()
    return spec.name


async def tick_retiring(sup: Supervisor, child: Child, now: float) -> None:
    """Stop a retiring worker once it is idle (or its drain timed out)."""
    if not child.retiring or child.stop_sent or child.state != WorkerState.RUNNING:
        return
    after_grace = child.retire_started + grace_s(sup)
    idle = now > after_grace and child.last_seen > after_grace and child.inflight == 0
    timed_out = now - child.retire_started > sup.config.drain_timeout
    if idle or timed_out:
        if timed_out and not idle:
            log.warning("%s still holds %d requests; stopping it", child.name, child.inflight)
        child.stop_sent = True
        child.restart_requested_at = now  # its exit is expected (Child.overdue kills late)
        await sup.broadcast(protocol.Stop(), [child])


def forget_retired(sup: Supervisor, child: Child) -> bool:
    """A retired worker exited: drop it (True) instead of restarting it."""
    if not child.retiring:
        return False
    log.info("%s retired (exit code %s)", child.name, child.exit_code())
    child.join(timeout=1.0)
    del sup.children[child.name]
    return True
