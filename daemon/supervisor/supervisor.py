"""lmdd's supervisor: spawns the workers, watches them, restarts them, drains and stops.

Life cycle of the daemon (states.DaemonState):
  1. starting: take the runtime-dir lock, remove a crashed daemon's sockets, bind the
     supervisor socket and the control socket, spawn every worker (spawn context).
  2. running: once every worker sent Ready within startup_timeout (the api's Ready comes
     after its port listens): READY=1. A worker that dies is restarted with exponential
     backoff; one that misses heartbeats for heartbeat_timeout is killed and restarted
     (the watchdog pings stop until its replacement is ready); max_fast_failures young
     deaths in a row and the daemon gives up (exit 1: Restart=on-failure acts); watch.py.
     `lmdctl reload` applies what can change live and reports what needs a restart;
     `lmdctl scale` adds and retires engine workers (scaling.py).
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
import dataclasses
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import zmq.asyncio
from starlette.types import ASGIApp

from lmd import __version__, ipc, protocol
from lmd.config import ConfigError
from lmd.config_loader import LoadedConfig, reload_config
from lmd.gpu_sharing import GpuSharingError, control_daemon
from lmd.http_server import EmbeddedServer, bind_unix
from lmd.paths import control_socket_path
from lmd.roles import plan_workers
from lmd.supervisor.announcer import Announcer
from lmd.supervisor.child import Child
from lmd.supervisor.errors import BadConfig, UnknownWorker, WrongState
from lmd.supervisor.runtime_lock import RuntimeLock
from lmd.supervisor.scaling import Scaler
from lmd.supervisor.sd_notify import Notifier
from lmd.supervisor.service_notify import ServiceNotifier, status_line
from lmd.supervisor.states import DaemonState, WorkerState, transition
from lmd.supervisor.watch import LIVE, STOP_GRACE_S, Change, GiveUp, WorkerWatch
from lmd.worker import set_log_level

log = logging.getLogger(__name__)

TICK_S = 0.1
CONTROL_SOCKET_MODE = 0o660


ControlApp = Callable[["Supervisor"], ASGIApp]  # the control API over this supervisor


class Supervisor:
    def __init__(
        self,
        loaded: LoadedConfig,
        device: str,
        pid: int,
        control_app: ControlApp,
        notifier: Notifier | None = None,
    ) -> None:
        config = loaded.config
        self.loaded = loaded  # the config as loaded, with where each value came from
        self.config = config  # what runs; a reload changes its live keys only
        self.device = device
        self.pid = pid
        self.state = DaemonState.STARTING
        self.children = {s.name: Child(s) for s in plan_workers(config, device, pid)}
        self.scaler = Scaler(self.children)  # lmdctl scale adds to and removes from children
        self._control_app = control_app
        self.endpoints = ipc.Endpoints(config.runtime_dir)
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        self.num_foreign = 0  # well-formed messages from no live worker of ours
        self._exit_code = 0
        self._force_stop = False
        self._drain_started = 0.0
        self._stop_reason = ""
        self.service = ServiceNotifier(notifier)
        self.watch = WorkerWatch(self.scaler)  # restarts; kills what is overdue
        # ClusterState to the workers; a cluster node's record in etcd
        self.announcer = Announcer(config, pid, self.children, lambda: self.state, self.broadcast)

    # Running ---------------------------------------------------------------------------

    async def run(self) -> int:
        """Run until stopped; return the process exit code. Raises AlreadyRunning."""
        lock = RuntimeLock(self.config.runtime_dir)
        lock.acquire()
        try:
            if removed := lock.remove_leftovers():
                log.info("removed %d stale sockets left by a previous daemon", len(removed))
            with control_daemon(self.config):  # --gpu-sharing mps: MPS for the workers
                return await self._serve()
        except GpuSharingError as exc:
            log.error("%s", exc)
            return 1
        finally:
            lock.remove_leftovers()
            lock.release()

    async def _serve(self) -> int:
        self._finished = asyncio.Event()
        ctx = zmq.asyncio.Context()
        self.router = ipc.bind_router(ctx, self.endpoints.supervisor, "supervisor")
        sock = bind_unix(control_socket_path(self.config.runtime_dir), CONTROL_SOCKET_MODE)
        control = EmbeddedServer(self._control_app(self), sock, self.config.log_level)
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
        child.scaled_in = False
        self.watch.ready(child)
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
            stopping = self.state == DaemonState.STOPPING
            for child in list(self.children.values()):
                verdict = self.watch.tick(child, now, self.config, stopping)
                if isinstance(verdict, GiveUp):
                    self.give_up(verdict.reason)
                elif verdict is Change.WORKERS:
                    await self.publish_cluster_state()
            for child in self.scaler.due_to_stop(now, self.config):
                await self.broadcast(protocol.Stop(), [child])
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
            self.service.watchdog(now, healthy=not self.watch.hung)
            if await self.announcer.tick(now, stopping=self.state == DaemonState.STOPPING):
                self.service.status(self.status_line)
            await asyncio.sleep(TICK_S)

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
        """Every running worker reported, since the drain began, that it holds nothing (one
        still starting, e.g. loading its model, was given no request and is not waited for)."""
        running = (c for c in self.live_children if c.state == WorkerState.RUNNING)
        return all(c.last_seen > self._drain_started and c.inflight == 0 for c in running)

    # Operations (the control API, control.py, calls these) ---------------------------

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
            raise UnknownWorker("unknown_worker", f"no worker named {name!r} ({known})")
        if self.state == DaemonState.STOPPING:
            raise WrongState("stopping", "the daemon is stopping")
        if child.state not in LIVE:
            raise WrongState("not_running", f"{name} is {child.state}, not running")
        child.restart_requested_at = time.monotonic()
        child.signal(signal.SIGTERM)
        log.info("restart of %s requested", name)

    async def drain(self) -> None:
        if self.state == DaemonState.STOPPING:
            raise WrongState("stopping", "the daemon is stopping")
        if self.state == DaemonState.STARTING:
            raise WrongState("starting", "the daemon is still starting")
        if self.state == DaemonState.RUNNING:
            self._set_state(DaemonState.DRAINING)
            log.info("draining: new requests are refused until resume")
            await self.broadcast(protocol.Drain())
            await self.publish_cluster_state()

    async def resume(self) -> None:
        if self.state != DaemonState.DRAINING:
            raise WrongState("not_draining", f"the daemon is {self.state}, not draining")
        self._set_state(DaemonState.RUNNING)
        log.info("resumed: admitting requests again")
        await self.broadcast(protocol.Resume())
        await self.publish_cluster_state()

    async def scale(self, role: str, count: int) -> dict[str, Any]:
        """Run `count` workers of `role` (scaling.py says how)."""
        parsed = self.scaler.check(role, count, self.config.mode)
        if self.state != DaemonState.RUNNING:
            raise WrongState(str(self.state), f"the daemon is {self.state}; try later")
        result = self.scaler.scale(parsed, count, self.config, self.device, self.pid)
        if result.changed:
            await self.publish_cluster_state()
        return result.to_json()

    async def reload(self) -> dict[str, Any]:
        """Read the config file and the environment again (the command line stays). Live
        keys (config_loader.LIVE_KEYS) apply at once, here and in every worker (a
        Reconfigure; a restarted or added worker starts with them too); other changed
        keys keep their running value and are reported as needing a restart. All or
        nothing: the whole file is checked, and everything derived from it built, before
        anything changes, so a bad file changes nothing (BadConfig)."""
        if self.state in (DaemonState.STARTING, DaemonState.STOPPING):
            raise WrongState(str(self.state), f"the daemon is {self.state}; try later")
        with self.service.reloading(lambda: self.status_line):
            try:
                loaded, plan = reload_config(self.loaded)
            except ConfigError as exc:
                raise BadConfig("bad_config", str(exc)) from None
            specs = {  # what a restarted worker runs with
                n: dataclasses.replace(c.spec, config=loaded.config.to_dict())
                for n, c in self.children.items()
            }
            live = protocol.Reconfigure({k: getattr(loaded.config, k) for k in plan.applied})
            reply = {"ok": True, "file": loaded.to_json()["file"], **plan.to_json()}
            # Nothing above changed the daemon; from here on nothing can fail on the file.
            self.loaded, self.config = loaded, loaded.config
            for name, spec in specs.items():
                self.children[name].spec = spec
            set_log_level(self.config.log_level)
            if plan.applied:
                await self.broadcast(live)
        log.info(
            "config reloaded: applied %s; needs a restart: %s",
            ", ".join(plan.applied) or "nothing",
            ", ".join(plan.needs_restart) or "nothing",
        )
        return reply
