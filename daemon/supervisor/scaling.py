"""`lmdctl scale ROLE N`: add or remove prefill/decode workers while the daemon serves.

Life cycle of a scaled worker:
  1. Adding: new workers (the lowest free indices) are spawned as at start-up; once
     Ready, ClusterState lists them and the tokenizer routes to them.
  2. Removing: the highest-index workers of the role retire. ClusterState names them in
     `draining`, so the tokenizer routes nothing new to them, while they stay in
     `workers`, so nothing they hold is failed.
  3. After a grace period (messages routed before the tokenizer heard of it still
     arrive), a retiring worker is stopped once a heartbeat says it holds no request,
     or when drain_timeout runs out (what it still holds then fails with an error, as
     for a worker that died).
  4. A retired worker that exits is forgotten, not restarted; so is an added one that
     exits before it was ever Ready (it could not start: the scale-up is undone).
The supervisor owns a Scaler, which changes the workers table it is given (the
supervisor's) and says which workers to stop instead of stopping them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from lmd.config import ServeConfig
from lmd.protocol.roles import SCALABLE_ROLES, Role
from lmd.roles import worker_spec
from lmd.supervisor.child import Child
from lmd.supervisor.errors import BadArgument, WrongState
from lmd.supervisor.states import WorkerState

log = logging.getLogger(__name__)

MAX_WORKERS = 64


@dataclass(frozen=True, slots=True)
class ScaleResult:
    role: Role
    count: int
    added: list[str]
    retiring: list[str]

    @property
    def changed(self) -> bool:
        return bool(self.added or self.retiring)

    def to_json(self) -> dict[str, object]:
        return {
            "role": self.role,
            "count": self.count,
            "added": self.added,
            "retiring": self.retiring,
        }


class Scaler:
    def __init__(self, children: dict[str, Child]) -> None:
        self.children = children  # the supervisor's workers by name; added and removed here

    @staticmethod
    def check(role: str, count: int, mode: str) -> Role:
        """The role to scale; BadArgument or WrongState when it cannot scale."""
        if role not in SCALABLE_ROLES:
            names = " or ".join(SCALABLE_ROLES)
            raise BadArgument("bad_role", f"{role!r} cannot scale; use {names}")
        if mode != "disaggregated":
            raise WrongState("hybrid_mode", "scaling needs --mode disaggregated")
        if not 1 <= count <= MAX_WORKERS:
            raise BadArgument("bad_count", f"{count} is out of range (1-{MAX_WORKERS})")
        return Role(role)

    def scale(
        self, role: Role, count: int, config: ServeConfig, device: str, pid: int
    ) -> ScaleResult:
        """Run `count` workers of `role`: spawn the missing ones, retire the extra."""
        serving = sorted(
            (c for c in self.children.values() if c.role == role and not c.retiring),
            key=lambda c: c.spec.index,
        )
        added: list[str] = []
        used = {c.spec.index for c in self.children.values() if c.role == role}
        free = (i for i in itertools.count() if i not in used)
        while len(serving) + len(added) < count:
            child = Child(worker_spec(config, role, next(free), device, pid))
            child.scaled_in = True
            self.children[child.name] = child
            child.spawn()
            added.append(child.name)
        retiring = []
        for child in serving[count:]:
            child.retiring = True
            child.retire_started = time.monotonic()
            retiring.append(child.name)
        result = ScaleResult(role, count, added, retiring)
        if result.changed:
            log.info(
                "scale %s to %d: adding %s; retiring %s",
                role,
                count,
                ", ".join(added) or "none",
                ", ".join(retiring) or "none",
            )
        return result

    def due_to_stop(self, now: float, config: ServeConfig) -> Iterator[Child]:
        """Retiring workers to stop now: idle after the grace period, or out of time.
        Each is yielded once; its exit is then expected (Child.overdue kills it late)."""
        grace = 2 * config.heartbeat_interval + 1.0  # routed work may still arrive
        for child in list(self.children.values()):
            if not child.retiring or child.stop_sent or child.state != WorkerState.RUNNING:
                continue
            after_grace = child.retire_started + grace
            idle = now > after_grace and child.last_seen > after_grace and child.inflight == 0
            timed_out = now - child.retire_started > config.drain_timeout
            if idle or timed_out:
                if timed_out and not idle:
                    log.warning(
                        "%s still holds %d requests; stopping it", child.name, child.inflight
                    )
                child.stop_sent = True
                child.restart_requested_at = now
                yield child

    def forget(self, child: Child) -> bool:
        """A retired worker exited, or an added one died before it was ever Ready: drop
        it (True) instead of restarting it. An added worker that cannot start (no memory
        left for its KV pool, a device gone) would fail the same way on every restart,
        and max_fast_failures of them would stop the whole daemon: the scale-up is
        undone instead, and the daemon serves on with the workers it had."""
        if child.scaled_in:
            log.error(
                "%s could not start (exit code %s; its log says why): scale-up of %s undone",
                child.name,
                child.exit_code(),
                child.role,
            )
        elif child.retiring:
            log.info("%s retired (exit code %s)", child.name, child.exit_code())
        else:
            return False
        child.join(timeout=1.0)
        del self.children[child.name]
        return True
