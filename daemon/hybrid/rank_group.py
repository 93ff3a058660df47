"""The other ranks of an engine worker's tensor-parallel group, as rank 0 keeps them.

Life cycle:
  1. `start()`, from the worker's main thread (a rank dies with the thread that spawned
     it: PR_SET_PDEATHSIG): the group's stale rendezvous file goes, rank 0 binds one op
     socket per rank and one reply socket, spawns ranks 1..N-1 (lmd.rank.process) and
     starts the reader thread.
  2. Rank 0 joins the group (engine/parallel.join_group) and builds its engine around a
     GroupBackend whose ops go out through `send`; the first op waits until every rank
     has loaded its shard (`ready`). A rank that cannot start answers `failed`: the
     worker's start fails with its line.
  3. The reader thread takes the ranks' replies (ready, pool descriptors, finished KV
     copies: `expect_copy`) and watches their processes: the first one to exit sets
     `dead` (who, with what code) and calls `on_death` once; from then on `send`
     raises RankError. The worker then fails its requests and exits: the supervisor
     restarts it, and it starts a new group (the other ranks die with it).
  4. `stop()`: stop to every rank, a bounded wait, SIGKILL for what is left; sockets
     and files removed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import torch
import zmq

from lmd.config import ServeConfig
from lmd.engine.group_backend import decode_op, encode_op
from lmd.engine.parallel import TensorParallel, join_group
from lmd.hybrid.step_thread import StepThread
from lmd.ipc import Endpoints
from lmd.rank.process import MAX_OP_BYTES, rank_main
from lmd.rank.spec import RankSpec
from lmd.roles import WorkerSpec, rank_devices

log = logging.getLogger(__name__)

_SPAWN = multiprocessing.get_context("spawn")
T = TypeVar("T")
READ_POLL_MS = 100  # the reader's pace when nothing comes: how soon a death is seen
STOP_WAIT_S = 5.0


@dataclass(slots=True)
class _Copy:
    done: Callable[[list[dict[str, Any]]], None]
    expected: int
    replies: list[dict[str, Any]] = field(default_factory=list)


class RankError(RuntimeError):
    """A rank of the group failed or is gone; the message names it, in one line."""


class RankGroup:
    def __init__(
        self,
        spec: WorkerSpec,
        config: ServeConfig,
        model_dir: Path,
        transport: str | None,
        *,
        thread: concurrent.futures.Executor | None = None,
    ) -> None:
        self.worker = spec.name
        # Where beside() runs its calls: the engine's step thread, else one of the group's.
        self.thread = thread or StepThread(f"{spec.name}-beside")
        self.size = spec.tp
        self.endpoints = Endpoints(config.runtime_dir)
        self.timeout_s = config.startup_timeout
        self.specs = [
            RankSpec(spec.to_dict(), rank, str(model_dir), transport)
            for rank in range(1, self.size)
        ]
        self.on_death: Callable[[str], None] | None = None
        self.dead: str | None = None  # why the group is broken, once it is
        self._ctx = zmq.Context()
        self._ops: list[zmq.Socket[bytes]] = []
        self._replies: zmq.Socket[bytes] | None = None
        self._procs: list[Any] = []
        self._ready: dict[int, dict[str, Any]] = {}
        self._descriptors: dict[int, bytes] = {}
        self._copies: dict[int, _Copy] = {}
        self._changed = threading.Condition()
        self._stopping = False
        self._reader: threading.Thread | None = None

    @property
    def rendezvous(self) -> Path:
        return self.endpoints.rendezvous(self.worker)

    def start(self) -> None:
        self.rendezvous.unlink(missing_ok=True)
        for spec in self.specs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(self.endpoints.rank_ops(self.worker, spec.rank))
            self._ops.append(sock)
        replies = self._replies = self._ctx.socket(zmq.PULL)
        replies.setsockopt(zmq.MAXMSGSIZE, MAX_OP_BYTES)
        replies.bind(self.endpoints.rank_replies(self.worker))
        for spec in self.specs:
            spec_dict = {**spec.to_dict(), "leader_pid": os.getpid()}  # spawned from here
            proc = _SPAWN.Process(target=rank_main, args=(spec_dict,), name=spec.name)
            proc.start()
            self._procs.append(proc)
        self._reader = threading.Thread(target=self._read, name=f"{self.worker}-ranks", daemon=True)
        self._reader.start()

    def ranks(self) -> list[dict[str, Any]]:
        """Ranks 1..N-1 as status lists them: rank, pid, device."""
        return [
            {"rank": spec.rank, "pid": proc.pid, "device": spec.device}
            for spec, proc in zip(self.specs, self._procs, strict=True)
        ]

    def memory(self) -> list[dict[str, Any]]:
        """Ranks 1..N-1's part of their GPUs' memory plans (each its budget and the
        weights it loaded; none on CPU), as their `ready` said."""
        return [
            self._ready[s.rank]["memory"]
            for s in self.specs
            if "memory" in self._ready.get(s.rank, {})
        ]

    def rss(self) -> list[int]:
        """Ranks 1..N-1's resident memory in bytes (0 for one that is gone)."""
        out = []
        for proc in self._procs:
            try:
                out.append(psutil.Process(proc.pid).memory_info().rss)
            except (psutil.Error, ValueError):
                out.append(0)
        return out

    # Ops --------------------------------------------------------------------------------

    def send(self, header: dict[str, Any], frames: Sequence[bytes] = ()) -> None:
        """One op to every rank, in rank order (engine/group_backend.OpLink)."""
        if len(self._ready) < len(self.specs):
            self.wait_ready()
        if self.dead is not None:
            raise RankError(self.dead)
        if self._stopping:  # a pool dropped after stop() (a pipeline's, collected later)
            raise RankError(f"the group of {self.worker} is stopped")
        message = encode_op(header, frames)
        for spec, sock in zip(self.specs, self._ops, strict=True):
            try:
                sock.send_multipart(message, copy=False)
            except zmq.Again:
                raise RankError(f"{spec.name} took no op for {self.timeout_s:.0f} s") from None

    def wait_ready(self) -> None:
        """Until every rank loaded its shard; RankError if one failed or died."""
        self._wait(lambda: len(self._ready) == len(self.specs), "load its shard")

    def descriptors(self) -> list[bytes]:
        """Ranks 1..N-1's pool descriptors (their migration transport's), in rank order,
        once their engine pools exist."""
        self._wait(lambda: len(self._descriptors) == len(self.specs), "make its KV pool")
        return [self._descriptors[spec.rank] for spec in self.specs]

    def expect_copy(self, op_id: int, done: Callable[[list[dict[str, Any]]], None]) -> None:
        """Call `done(replies)` (in the reader thread) once every rank has answered copy
        op `op_id` (a reply per rank: ok, nbytes, error)."""
        with self._changed:
            self._copies[op_id] = _Copy(done, len(self.specs))

    def _wait(self, ok: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._changed:
            while not ok():
                if self.dead is not None:
                    raise RankError(self.dead)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RankError(
                        f"a rank of {self.worker} did not {what} in {self.timeout_s:.0f} s"
                    )
                self._changed.wait(min(left, 1.0))

    # The reader thread --------------------------------------------------------------------

    def _read(self) -> None:
        assert self._replies is not None
        while not self._stopping:
            if self._replies.poll(READ_POLL_MS):
                try:
                    header, frames = decode_op(self._replies.recv_multipart())
                    self._on_reply(header, frames)
                except (ValueError, KeyError, TypeError, IndexError) as exc:  # not a rank's
                    log.warning("%s: dropped a reply that is not a rank's: %r", self.worker, exc)
            self._check_processes()

    def _on_reply(self, header: dict[str, Any], frames: Sequence[bytes]) -> None:
        rank, op = int(header["rank"]), header["op"]
        if op == "copied":
            op_id = int(header["id"])
            with self._changed:
                copy = self._copies.get(op_id)
                if copy is None:
                    return
                copy.replies.append(header)
                if len(copy.replies) < copy.expected:
                    return
                del self._copies[op_id]
            copy.done(copy.replies)
            return
        with self._changed:
            if op == "ready":
                self._ready[rank] = header
            elif op == "pool":
                self._descriptors[rank] = bytes(frames[0])
            elif op == "failed":
                self._broken(f"{self.worker} rank {rank} failed: {header['error']}")
            self._changed.notify_all()

    def _check_processes(self) -> None:
        for spec, proc in zip(self.specs, self._procs, strict=True):
            if proc.exitcode is not None and not self._stopping:
                with self._changed:
                    self._broken(
                        f"tensor-parallel {spec.name} (pid {proc.pid}) exited with code "
                        f"{proc.exitcode}"
                    )
                    self._changed.notify_all()
                return

    def _broken(self, reason: str) -> None:
        """The first failure: remembered, logged and told (the lock is held)."""
        if self.dead is not None:
            return
        self.dead = reason
        log.error("%s", reason)
        if self.on_death is not None:
            self.on_death(reason)

    def wait_dead(self, timeout_s: float) -> str | None:
        """Why the group broke, waiting up to `timeout_s` to see it (a collective that
        failed on this rank fails a moment before the rank's exit is seen)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.dead is None and time.monotonic() < deadline:
                self._changed.wait(0.05)
        return self.dead

    async def beside(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the group's thread (the engine's step thread) while
        watching the group: a rank that fails or dies meanwhile is a RankError at once,
        not a wait in a collective (NCCL's waits on a dead peer end only at the group's
        timeout). A daemon thread (step_thread.py): one left waiting there does not hold
        the process's exit."""
        done = self.thread.submit(fn, *args, **kwargs)
        while not done.done():
            if self.dead is not None:
                raise RankError(self.dead)
            await asyncio.sleep(0.05)
        return done.result()

    # Stopping -----------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping = True
        message = encode_op({"op": "stop"})
        for sock in self._ops:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(message, flags=zmq.NOBLOCK)
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(1.0)
        if self._reader is not None:
            self._reader.join(1.0)
        self._ctx.destroy(linger=0)
        for spec in self.specs:
            _remove(self.endpoints.rank_ops(self.worker, spec.rank))
        _remove(self.endpoints.rank_replies(self.worker))
        self.rendezvous.unlink(missing_ok=True)


def _remove(endpoint: str) -> None:
    Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


async def start_group(
    spec: WorkerSpec,
    config: ServeConfig,
    model_dir: Path,
    device: str,
    transport: str | None,
    *,
    thread: concurrent.futures.Executor | None = None,
) -> tuple[RankGroup, TensorParallel]:
    """Ranks 1..N-1 of `spec`'s group started, and this process joined as rank 0; a
    rank that fails or dies first is a RankError naming it (the group is stopped)."""
    devices = rank_devices(device, spec.tp)
    missing = [d for d in devices if d.startswith("cuda") and int(d[5:]) >= _num_gpus()]
    if missing:
        raise RankError(
            f"tp {spec.tp} from {device} needs {devices[0]}..{devices[-1]}; this host has "
            f"{_num_gpus()} GPUs"
        )
    group = RankGroup(spec, config, model_dir, transport, thread=thread)
    group.start()
    try:
        rendezvous = group.rendezvous
        tp = await group.beside(
            join_group, 0, spec.tp, rendezvous, torch.device(device), group.timeout_s
        )
        return group, tp
    except BaseException:
        await asyncio.to_thread(group.stop)
        raise


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
