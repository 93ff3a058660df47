"""lmdd's supervisor: spawns the workers, watches them, restarts them, drains and stops.

Life cycle of the daemon (states.DaemonState):
  1. starting: take the runtime-dir lock, remove a crashed daemon's sockets, bind the
     supervisor socket and the control socket, spawn every worker (spawn context).
  2. running: once every worker sent Ready within startup_timeout (the api's Ready comes
     after its port listens): READY=1. A worker that dies is restarted with exponential
     backoff; one that misses heartbeats for heartbeat_timeout is killed and restarted
     (the watchdog pings stop until its replacement is ready); max_fast_failures young
     deaths in a row and the daemon gives up (exit 1: Restart=on-failure acts).
     `lmdctl reload` applies what can change live and reports what needs a restart.
  3. draining (`lmdctl drain`): workers stop admitting; `resume` returns to running.
  4. stopping (SIGTERM, SIGINT, `lmdctl shutdown`, giving up): STOPPING=1, Drain, wait
     until no worker holds a request (up to drain_timeout; a second signal cuts it
     short), Stop, SIGKILL what is still alive after a grace period, release the lock,
     exit.
Signal handlers only request the stop; the stop itself runs as a task on the loop.
What systemd hears at each step (READY, STATUS, WATCHDOG, ...): service_notify.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

import zmq.asyncio

from lmd import __version__, ipc, protocol
from lmd.config_loader import LoadedConfig
from lmd.http_server import EmbeddedServer, bind_unix
from lmd.paths import control_socket_path
from lmd.roles import plan_workers
from lmd.supervisor import scaling
from lmd.supervisor.announcer import Announcer
from lmd.supervisor.child import Child, describe_exit
from lmd.supervisor.control import ControlError, build_control_app
from lmd.supervisor.runtime_lock import RuntimeLock
from lmd.supervisor.sd_notify import Notifier
from lmd.supervisor.service_notify import ServiceNotifier, status_line
from lmd.supervisor.states import DaemonState, WorkerState, transition

log = logging.getLogger(__name__)

TICK_S = 0.1
STOP_GRACE_S = 5.0  # after Stop, how long a worker may take to exit before SIGKILL
CONTROL_SOCKET_MODE = 0o660
LIVE = (WorkerState.STARTING, WorkerState.RUNNING)


class Supervisor:
    def __init__(
        self, loaded: LoadedConfig, device: str, pid: int, notifier: Notifier | None = None
    ) -> None:
        config = loaded.config
        self.loaded = loaded  # the config as loaded, with where each value came from
        self.config = config  # what runs; a reload changes its live keys only
        self.device = device
        self.pid = pid
        self.state = DaemonState.STARTING
        self.children = {s.name: Child(s) for s in plan_workers(config, device, pid)}
        self.endpoints = ipc.Endpoints(config.runtime_dir)
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        self.num_foreign = 0  # well-formed messages from no live worker of ours
        self._exit_code = 0
        self._force_stop = False
        self._drain_started = 0.0
        self._stop_reason = ""
        self.service = ServiceNotifier(notifier)
        self._hung: set[str] = set()  # killed for missing heartbeats, not yet back
        self.announcer = Announcer(self)  # ClusterState; a cluster node's etcd record

    # Running ---------------------------------------------------------------------------

    async def run(self) -> int:
        """Run until stopped; return the process exit code. Raises AlreadyRunning."""
        lock = RuntimeLock(self.config.runtime_dir)
        lock.acquire()
        try:
            if removed := lock.remove_sockets():
                log.info("removed %d stale sockets left by a previous daemon", len(removed))
            return await self._serve()
        finally:
            lock.remove_sockets()
            lock.release()

    async def _serve(self) -> int:
        self._finished = asyncio.Event()
        ctx = zmq.asyncio.Context()
        self.router = ipc.bind_router(ctx, self.endpoints.supervisor, "supervisor")
        sock = bind_unix(control_socket_path(self.config.runtime_dir), CONTROL_SOCKET_MODE)
        control = EmbeddedServer(build_control_app(self), sock, self.config.log_level)
        await control.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        log.info(
            "lmdd %s starting %d workers (model %s, device %s, runtime dir %s)",
            __version__,
            len(self.children),
            self.config.served_model_name,
            self.device,
            self.config.runtime_dir,
        )
        if not await self.announcer.join():
            await control.stop()
            self.router.close()
            ctx.term()
            return 1
        for child in self.children.values():
            child.spawn()
        self.service.status(self.status_line)
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._tick_loop())]
        await self._finished.wait()
        for task in tasks:
            task.cancel()
        await self.announcer.leave()
        await control.stop()
        self.router.close()
        ctx.term()
        self.service.close()
        log.info("lmdd stopped (exit code %d)", self._exit_code)
        return self._exit_code

    def _set_state(self, new: DaemonState) -> None:
        self.state = transition(self.state, new)

    @property
    def live_children(self) -> list[Child]:
        return [c for c in self.children.values() if c.state in LIVE]

    @property
    def missing_roles(self) -> list[str]:
        """Roles this daemon runs (hybrid mode runs no prefill/decode) with none running."""
        up = {c.role for c in self.children.values() if c.state == WorkerState.RUNNING}
        return [r for r in self.announcer.planned_roles if r not in up]

    async def broadcast(self, msg: protocol.Message, children: list[Child] | None = None) -> None:
        for child in self.live_children if children is None else children:
            await self.router.send(child.name, msg)

    async def publish_cluster_state(self) -> None:
        await self.announcer.publish()
        self.service.status(self.status_line)

    @property
    def status_line(self) -> str:
        workers = {c.name: c.state for c in self.children.values()}
        return status_line(self.state, workers, self._stop_reason)

    async def _recv_loop(self) -> None:
        while True:
            name, msg = await self.router.recv()
            child = self.children.get(name)
            if child is None:
                self.num_foreign += 1
                log.warning("dropped %s from unknown peer %r", type(msg).__name__, name)
                continue
            if child.state not in LIVE:
                continue  # late message from a process that already ended
            if isinstance(msg, protocol.Heartbeat):
                child.heard(msg)
            elif isinstance(msg, protocol.Ready) and msg.pid == child.pid:
                child.last_seen = time.monotonic()
                await self._on_ready(child, msg)
            else:
                self.num_foreign += 1
                log.warning("dropped unexpected %s from %s", type(msg).__name__, name)

    async def _on_ready(self, child: Child, msg: protocol.Ready) -> None:
        child.info = msg.info
        child.set_state(WorkerState.RUNNING)
        self._hung.discard(child.name)
        log.info(
            "%s ready (pid %d) after %.1f s",
            child.name,
            msg.pid,
            time.monotonic() - child.started_mono,
        )
        if (
            self.state == DaemonState.STARTING
            and not self.missing_roles
            and all(c.state == WorkerState.RUNNING for c in self.children.values())
        ):
            self._set_state(DaemonState.RUNNING)
            log.info(
                "lmdd running: %d workers ready in %.1f s",
                len(self.children),
                time.monotonic() - self.started_mono,
            )
            self.service.ready(self.status_line)
        if self.state in (DaemonState.DRAINING, DaemonState.STOPPING):
            await self.router.send(child.name, protocol.Drain())
        await self.publish_cluster_state()

    async def _tick_loop(self) -> None:
        while True:
            now = time.monotonic()
            for child in list(self.children.values()):
                await self._tick_child(child, now)
                await scaling.tick_retiring(self, child, now)
            if (
                self.state == DaemonState.STARTING
                and now - self.started_mono > self.config.startup_timeout
            ):
                waiting = ", ".join(
                    c.name for c in self.children.values() if c.state != WorkerState.RUNNING
                )
                self.give_up(
                    f"start-up took over {self.config.startup_timeout:.0f} s; not ready: {waiting}"
                )
            # Healthy = every worker that missed its heartbeats has a ready replacement.
            self.service.watchdog(now, healthy=not self._hung)
            if await self.announcer.tick(now, stopping=self.state == DaemonState.STOPPING):
                self.service.status(self.status_line)
            await asyncio.sleep(TICK_S)

    async def _tick_child(self, child: Child, now: float) -> None:
        cfg = self.config
        if child.state in LIVE:
            code = child.exit_code()
            if code is not None:
                await self._on_exit(child, code, now)
            elif reason := child.overdue(
                now, cfg.heartbeat_timeout, cfg.startup_timeout, STOP_GRACE_S
            ):
                log.error("%s (pid %s) %s; killing it", child.name, child.pid, reason)
                if child.missed_heartbeats(now, cfg.heartbeat_timeout):
                    self._hung.add(child.name)  # the watchdog stops until it is back
                child.signal(signal.SIGKILL)
        elif (
            child.state == WorkerState.RESTARTING
            and self.state != DaemonState.STOPPING
            and child.next_start_at is not None
            and now >= child.next_start_at
        ):
            child.num_restarts += 1
            log.info("restarting %s (restart #%d)", child.name, child.num_restarts)
            child.spawn()

    async def _on_exit(self, child: Child, code: int, now: float) -> None:
        if self.state == DaemonState.STOPPING:
            child.last_exit = code
            child.set_state(WorkerState.STOPPED)
            return
        if scaling.forget_retired(self, child):
            await self.publish_cluster_state()
            return
        if child.restart_requested_at is None:
            ran = now - child.started_mono
            log.warning(
                "%s (pid %s) died (%s) after %.1f s",
                child.name,
                child.pid,
                describe_exit(code),
                ran,
            )
        policy = self.config.restart
        delay = child.record_exit(code, now, policy)
        if delay is None:
            child.set_state(WorkerState.FAILED)
            self.give_up(
                f"{child.name} died {child.num_fast_failures} times in a row "
                f"within {policy.stable_after_s:.0f} s of starting (last: {describe_exit(code)})"
            )
            return
        child.set_state(WorkerState.RESTARTING)
        child.next_start_at = now + delay
        await self.publish_cluster_state()

    # Stopping --------------------------------------------------------------------------

    def request_stop(self, reason: str, exit_code: int = 0, drain: bool = True) -> None:
        """Begin stopping; called again while stopping, it skips the rest of the drain."""
        if self.state == DaemonState.STOPPING:
            self._force_stop = True
            log.warning("stop requested again (%s): not waiting for the drain", reason)
            return
        self._set_state(DaemonState.STOPPING)
        self._exit_code = exit_code
        self._force_stop = not drain
        self._stop_reason = reason
        log.info("stopping (%s)", reason)
        self.service.stopping(self.status_line)
        self._stop_task = asyncio.get_running_loop().create_task(self._stop())

    def give_up(self, reason: str) -> None:
        log.error("giving up: %s", reason)
        self.request_stop(f"giving up: {reason}", exit_code=1, drain=False)

    async def _stop(self) -> None:
        await self.publish_cluster_state()
        await self.broadcast(protocol.Drain())
        self._drain_started = time.monotonic()
        deadline = self._drain_started + self.config.drain_timeout
        while not self._force_stop and time.monotonic() < deadline and not self._drained():
            await asyncio.sleep(TICK_S)
        if not self._force_stop and not self._drained():
            log.warning(
                "drain timed out after %.0f s; stopping with requests in flight",
                self.config.drain_timeout,
            )
        await self.broadcast(protocol.Stop())
        deadline = time.monotonic() + STOP_GRACE_S
        while self.live_children and time.monotonic() < deadline:
            await asyncio.sleep(TICK_S)
        for child in self.live_children:
            log.warning(
                "%s (pid %s) did not stop in %.0f s; killing it",
                child.name,
                child.pid,
                STOP_GRACE_S,
            )
            child.signal(signal.SIGKILL)
        for child in self.children.values():
            child.join(timeout=5.0)
            if child.state != WorkerState.STOPPED:
                child.set_state(WorkerState.STOPPED)
        self._finished.set()

    def _drained(self) -> bool:
        """Every live worker reported, since the drain began, that it holds nothing."""
        return all(
            c.last_seen > self._drain_started and c.inflight == 0 for c in self.live_children
        )

    # Control API (control.py calls these) ----------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "state": str(self.state),
            "pid": self.pid,
            "version": __version__,
            "uptime_s": round(time.monotonic() - self.started_mono, 3),
            "model": self.config.served_model_name,
            "device": self.device,
            "runtime_dir": str(self.config.runtime_dir),
            "num_dropped": self.router.num_dropped + self.num_foreign,
            "workers": self.workers(),
            **({"cluster": cluster.status()} if (cluster := self.announcer.cluster) else {}),
        }

    def workers(self) -> list[dict[str, Any]]:
        return [c.to_status() for c in self.children.values()]

    def restart_worker(self, name: str) -> None:
        child = self.children.get(name)
        if child is None:
            known = ", ".join(self.children)
            raise ControlError(404, "unknown_worker", f"no worker named {name!r} ({known})")
        if self.state == DaemonState.STOPPING:
            raise ControlError(409, "stopping", "the daemon is stopping")
        if child.state not in LIVE:
            raise ControlError(409, "not_running", f"{name} is {child.state}, not running")
        child.restart_requested_at = time.monotonic()
        child.signal(signal.SIGTERM)
        log.info("restart of %s requested", name)

    async def drain(self) -> None:
        if self.state == DaemonState.STOPPING:
            raise ControlError(409, "stopping", "the daemon is stopping")
        if self.state == DaemonState.STARTING:
            raise ControlError(409, "starting", "the daemon is still starting")
        if self.state == DaemonState.RUNNING:
            self._set_state(DaemonState.DRAINING)
            log.info("draining: new requests are refused until resume")
            await self.broadcast(protocol.Drain())
            await self.publish_cluster_state()

    async def resume(self) -> None:
        if self.state != DaemonState.DRAINING:
            raise ControlError(409, "not_draining", f"the daemon is {self.state}, not draining")
        self._set_state(DaemonState.RUNNING)
        log.info("resumed: admitting requests again")
        await self.broadcast(protocol.Resume())
        await self.publish_cluster_state()
