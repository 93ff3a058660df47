"""A worker process: what every role (tokenizer, prefill, decode, api) shares.

Life cycle of a worker:
  1. The supervisor spawns it (spawn context) with a WorkerSpec as a plain dict.
  2. `worker_main` (spawn.py) ties it to the supervisor (PR_SET_PDEATHSIG=SIGKILL, and
     exits if the supervisor is already gone), moves it into its own process group, sets
     up logging, and builds the role's Worker subclass.
  3. `Worker.run` connects to the supervisor (DEALER, identity = worker name), binds its
     inbox, runs the role's `start()` (load a model, listen on a port), then sends Ready.
  4. Running: a Heartbeat every heartbeat_interval; control messages from the supervisor
     (Drain, Resume, Stop, ClusterState); data messages on the inbox go to `handle()`,
     unless they name a worker this one does not know (`knows`). A message whose
     handler raises is logged, counted as dropped and, if it is a request, answered
     with RequestError(internal_error); the worker goes on.
  5. Stop (or SIGTERM): the role's `stop()`, sockets closed, exit 0. A start-up failure
     exits 1 with a one-line reason, which the supervisor logs and counts.
  6. An essential task ends (`watch`, essential.py: the heartbeat, the control and
     inbox loops, and what roles add): its traceback is logged, the heartbeat stops,
     the role gets FATAL_STOP_S to stop, and the process exits 1; the supervisor
     restarts it and its requests fail at once, never hang behind a live heartbeat.
     The heartbeat itself survives transient errors (EMFILE reading /proc): it sends
     the last stats it could read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import psutil
import zmq.asyncio

from lmd import ipc, protocol
from lmd.config import ServeConfig
from lmd.essential import EssentialTasks
from lmd.ipc import Endpoints, should_log
from lmd.peers import Peers
from lmd.protocol import Message, Role
from lmd.roles import WorkerSpec, worker_names
from lmd.stage_times import StageTimes

if TYPE_CHECKING:
    from lmd.cluster.keys import ClusterKey

log = logging.getLogger(__name__)

GC_THRESHOLD = 20_000  # allocations between young collections (Python's default: 700)
FATAL_STOP_S = 2.0  # after an essential task ended: how long the role's stop() may take
T = TypeVar("T")


# A worker that exits with this code before it was ever ready would fail the same way on
# every restart (its GPU memory plan cannot hold it): the supervisor gives up at once.
EXIT_CANNOT_START = 78  # EX_CONFIG


class WorkerStartError(RuntimeError):
    """The role cannot start; the message is the one line the operator sees. `permanent`:
    a restart would fail the same way (exit EXIT_CANNOT_START)."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def configure_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s",
    )


def set_log_level(level: str) -> None:
    """The level of every lmd logger and uvicorn's, in this process."""
    for name in ("", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(level.upper())


class Worker:
    """The shared half of every role; subclasses override the hooks at the bottom."""

    role: ClassVar[Role]

    def __init__(self, spec: WorkerSpec, config: ServeConfig) -> None:
        self.spec = spec
        self.config = config
        self.endpoints = Endpoints(config.runtime_dir)
        self.draining = False
        self.cluster_state = "starting"
        self.missing_roles: list[str] = []
        self.workers: dict[str, int] = {}  # running workers by name -> pid (ClusterState)
        self.draining_workers: list[str] = []  # of those, the ones being retired
        self.load: dict[str, dict[str, int]] = {}  # engines' published load (tokenizer/routing.py)
        self.remote: dict[str, str] = {}  # workers on other cluster nodes -> tcp endpoint
        self.tcp_endpoint: str | None = None  # a cluster node's: where other hosts reach us
        self._stop = asyncio.Event()
        self.tasks = EssentialTasks(spec.name, self._stop.set)
        self._num_unexpected = 0
        self._proc = psutil.Process()
        self._last_stats: dict[str, Any] = {}  # what the heartbeat sends if reading fails
        self.stages = StageTimes()  # where requests' time goes here (stage_times.py)
        self.num_heartbeat_errors = 0
        self._peers = Peers(self._open_peer, functools.partial(self.watch, may_return=True))
        # Every name this worker may answer or talk to: its node's plan, and every worker
        # of every cluster view it received (a restarted peer keeps its name).
        self._known = {n for role in Role for n in worker_names(config, role)}

    @property
    def num_dropped(self) -> int:
        return self.control.num_dropped + self.inbox.num_dropped + self._num_unexpected

    async def run(self) -> int:
        self.ctx = ctx = zmq.asyncio.Context()
        self.control = ipc.connect_dealer(ctx, self.endpoints.supervisor, self.spec.name)
        self.inbox = self._bind_inbox(ctx)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        try:
            await self.start()
        except WorkerStartError as exc:
            log.error("%s cannot start: %s", self.spec.name, exc)
            return EXIT_CANNOT_START if exc.permanent else 1
        # What start() built (a model, a tokenizer, FastAPI's schemas) lives as long as the
        # process: leave it out of every collection from now on. Per-request and per-token
        # objects die by reference count; a higher first threshold lets most die before a
        # young collection scans them (with Python's default of 700 the api spent a
        # noticeable share of its CPU in GC: docs/benchmarks.md, 'Per-request and
        # per-token CPU in the api and tokenizer').
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
        info = {"backend": self.spec.backend, "device": self.spec.device, **self.info()}
        if self.tcp_endpoint:
            info["endpoint"] = self.tcp_endpoint
        await self.control.send(protocol.Ready(self.spec.name, os.getpid(), info))
        log.info("%s ready", self.spec.name)
        tasks = [
            self.watch(self._heartbeats(), "the heartbeat"),
            self.watch(self._control_loop(), "the control loop"),
            self.watch(self._inbox_loop(), "the inbox loop"),
        ]
        await self._stop.wait()
        self.tasks.stopping = True
        for task in tasks:
            task.cancel()
        if self.exit_code:
            await self._stop_role_quickly()
        else:
            await self.stop()
        self._peers.close()
        self.control.close()
        self.inbox.close()
        if self.exit_code:
            ctx.destroy(linger=0)  # closes what a failed role left open; term() would wait
        else:
            ctx.term()
        return self.exit_code

    @property
    def exit_code(self) -> int:
        return 1 if self.tasks.failed else 0

    def watch(
        self, work: Coroutine[Any, Any, T] | asyncio.Task[T], what: str, *, may_return: bool = False
    ) -> asyncio.Task[T]:
        """Run `work` as an essential task (essential.py): if it ends while the worker
        runs, the worker exits 1 (step 6 above)."""
        return self.tasks.watch(work, what, may_return=may_return)

    async def _stop_role_quickly(self) -> None:
        """The role's stop() after a failure: bounded, and its own failure only logged."""
        try:
            await asyncio.wait_for(self.stop(), FATAL_STOP_S)
        except Exception as exc:  # the role's state is what failed: nothing to save
            log.warning("%s: did not stop cleanly: %r", self.spec.name, exc)

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self._send_heartbeat()
            except Exception as exc:  # transient (a full queue, a signal): beat on
                self._heartbeat_error("heartbeat not sent", exc)
            await asyncio.sleep(self.config.heartbeat_interval)

    async def _send_heartbeat(self) -> None:
        stats = {
            **self._beat_stats(),
            "num_lost": self._peers.num_lost,
            "num_waiting": self._peers.num_waiting,  # in backlogs to peers behind (peers.py)
            "num_held": self._peers.num_held,  # that ever waited there
            # cluster nodes: TCP peers refused for lacking the cluster key (links.py)
            "num_refused": getattr(self.inbox, "num_refused", 0),
        }
        beat = protocol.Heartbeat(self.spec.name, self.inflight(), self.num_dropped, stats)
        await self.control.send(beat)

    def _beat_stats(self) -> dict[str, Any]:
        """RSS and the role's stats; when they cannot be read (EMFILE opening /proc, a
        role's bug), the last ones read: a beat goes out whatever its numbers."""
        try:
            cpu = self._proc.cpu_times()
            stats = {
                "rss_bytes": self._proc.memory_info().rss,
                "cpu_s": round(cpu.user + cpu.system, 3),
                "stages": self.stages.to_dict(),
                **self.stats(),
            }
        except Exception as exc:
            self._heartbeat_error("stats not read, the last ones sent", exc)
            return self._last_stats
        self._last_stats = stats
        return stats

    def _heartbeat_error(self, what: str, exc: Exception) -> None:
        self.num_heartbeat_errors += 1
        if should_log(self.num_heartbeat_errors):
            log.warning("%s: %s: %r", self.spec.name, what, exc)

    async def _control_loop(self) -> None:
        while True:
            msg = await self.control.recv()
            if isinstance(msg, protocol.Stop):
                self._stop.set()
            elif isinstance(msg, protocol.Drain):
                self.draining = True
                await self._send_heartbeat()  # the supervisor waits for a fresh inflight
            elif isinstance(msg, protocol.Resume):
                self.draining = False
            elif isinstance(msg, protocol.Reconfigure):
                self._reconfigure(msg.values)
            elif isinstance(msg, protocol.ClusterState):
                self._known.update(msg.workers)
                self.cluster_state, self.missing_roles = msg.state, msg.missing_roles
                self.workers, self.draining_workers = msg.workers, msg.draining
                self.load, self.remote = msg.load, msg.endpoints
                self.on_cluster_state()
            else:
                self._unexpected(msg, "control")

    async def _inbox_loop(self) -> None:
        while True:
            msg = await self.inbox.recv()  # yields to the loop every ipc.RECV_BATCH
            stranger = next((n for n in protocol.peer_names(msg) if n not in self._known), None)
            if stranger is not None:
                kind = type(msg).__name__
                self.count_dropped(f"{kind} naming {stranger!r}, no worker of this cluster")
                continue
            try:
                taken = await self.handle(msg)
            except Exception:
                self._handler_failed(msg)
                continue
            if not taken:
                self._unexpected(msg, "inbox")

    def knows(self, name: str) -> bool:
        """A worker of this node's plan or of a cluster view: messages may name only these."""
        return name in self._known

    def _handler_failed(self, msg: Message) -> None:
        """One message's handler raised: log, count and drop it, and fail its request."""
        self._num_unexpected += 1
        if should_log(self._num_unexpected):
            log.exception("%s: handling %s failed; dropped", self.spec.name, type(msg).__name__)
        request_id, reply_to = getattr(msg, "request_id", None), getattr(msg, "reply_to", None)
        if isinstance(request_id, str) and isinstance(reply_to, str):
            why = f"{self.spec.name} failed on this request; see its log"
            self.push(reply_to, protocol.RequestError(request_id, "internal_error", why))

    def _reconfigure(self, values: dict[str, Any]) -> None:
        """Apply live config keys (lmdctl reload); a bad value is logged and ignored."""
        try:
            self.config = dataclasses.replace(self.config, **values)
        except (TypeError, ValueError) as exc:
            log.error("%s: reload not applied: %s", self.spec.name, exc)
            return
        if "log_level" in values:
            set_log_level(self.config.log_level)
        self.on_reconfigure(set(values))
        log.info("%s: applied %s", self.spec.name, ", ".join(sorted(values)))

    def _bind_inbox(self, ctx: zmq.asyncio.Context) -> ipc.Channel:
        """The PULL inbox: at `<runtime>/<name>.ipc` and, on a cluster node, also on TCP
        at the advertised host (CURVE-authenticated with the cluster key)."""
        endpoint, label = self.endpoints.inbox(self.spec.name), f"{self.spec.name} inbox"
        if self.config.cluster is None:
            return ipc.bind_pull(ctx, endpoint, label)
        from lmd.cluster import links

        channel, self.tcp_endpoint = links.bind_inbox(
            ctx, endpoint, label, self.config.advertise_host, self.cluster_key
        )
        return channel

    @functools.cached_property
    def cluster_key(self) -> ClusterKey:
        from lmd.cluster.keys import ClusterKey

        assert self.config.cluster_key is not None  # config checks it in cluster mode
        return ClusterKey.load(Path(self.config.cluster_key))

    def push(self, worker_name: str, msg: Message) -> bool:
        """Send `msg` to another worker's inbox without waiting: now, or in order once the
        peer makes room (peers.py); False (counted in num_lost) if it is lost. A worker on
        another cluster node is reached over TCP, at the endpoint its node published (a
        new one after a restart)."""
        endpoint = self.remote.get(worker_name) or self.endpoints.inbox(worker_name)
        return self._peers.send(worker_name, endpoint, msg)

    @property
    def num_peers(self) -> int:
        """PUSH channels open to other workers (at most peers.MAX_PEERS)."""
        return len(self._peers)

    def _open_peer(self, worker_name: str, endpoint: str) -> ipc.Channel:
        label = f"{self.spec.name}->{worker_name}"
        if endpoint.startswith("tcp://"):
            from lmd.cluster import links

            return links.connect_push(self.ctx, endpoint, label, self.cluster_key)
        return ipc.connect_push(self.ctx, endpoint, label)

    def _unexpected(self, msg: Message, where: str) -> None:
        self.count_dropped(f"unexpected {type(msg).__name__} on {where}")

    def count_dropped(self, what: str) -> None:
        """A message that did not fit: logged (rate-limited), counted (num_dropped), dropped."""
        self._num_unexpected += 1
        if should_log(self._num_unexpected):
            log.warning("%s: dropped %s (#%d)", self.spec.name, what, self._num_unexpected)

    # Hooks for roles ------------------------------------------------------------------

    async def start(self) -> None:
        """Load what the role needs; raise WorkerStartError with a one-line reason."""

    async def stop(self) -> None:
        """Release what start() took."""

    async def handle(self, msg: Message) -> bool:
        """Handle a data-path message; False means this role does not take it."""
        return False

    def on_cluster_state(self) -> None:
        """The daemon's state or its set of running roles changed."""

    def on_reconfigure(self, keys: set[str]) -> None:
        """`self.config` has new values for `keys` (live keys of a reload)."""

    def info(self) -> dict[str, Any]:
        """Facts sent once with Ready (shown in status)."""
        return {}

    def stats(self) -> dict[str, Any]:
        """Numbers sent with every heartbeat (shown in status)."""
        return {}

    def inflight(self) -> int:
        """Requests this worker holds; a drain waits for every worker to reach 0."""
        return 0
