"""A rank process of a tensor-parallel group (rank >= 1; rank 0 is the engine worker).

Life cycle:
  1. Rank 0 (hybrid/rank_group.py) spawns it from its main thread with a RankSpec; it
     names itself (`lmd: decode-0 rank 1`), dies with rank 0 (PR_SET_PDEATHSIG), connects
     to rank 0's op and reply sockets, joins the group (engine/parallel.py) and loads its
     shard of the model (the backend rank 0 picks for the same model and device); a
     disaggregated role also registers its pool with the migration transport. It answers
     `ready` (or `failed` with one line, and exits 1).
  2. Running: ops from rank 0, in order (engine/group_backend.py: forwards, pools, graph
     captures; a prefill rank's `copy`: its heads of a prompt's KV into the decode
     group's pools, rank/copies.py). When its engine pool exists it sends that pool's
     descriptor (decode ranks: rank 0 puts every rank's in its reservations).
  3. `stop`, or rank 0's death (SIGKILL), ends it. An op that fails is logged and ends
     the process with exit 1: its collectives then fail on every other rank, and rank 0
     restarts the whole group (its worker exits; the supervisor restarts it).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import torch
import zmq
from setproctitle import setproctitle

from lmd.engine.backends import load_backend
from lmd.engine.group_backend import RankRunner, decode_op, encode_op
from lmd.engine.memory_profile import cap_allocator
from lmd.engine.parallel import join_group
from lmd.hybrid.gpu_budget import claim_gpu_budget
from lmd.hybrid.pool_ledger import PoolLedger
from lmd.migration.base import PoolMemory
from lmd.migration.shards import BlockLayout, Shard
from lmd.migration.transports import pool_memory
from lmd.parent import die_with_parent, exit_without_teardown
from lmd.protocol.roles import Role
from lmd.rank.copies import Copier
from lmd.rank.spec import RankSpec
from lmd.worker import configure_logging

log = logging.getLogger(__name__)

# The most bytes an op may take (a prefill step's batch: ~40 bytes per token).
MAX_OP_BYTES = 64 << 20
COPY_POLL_MS = 2  # how often copies in flight are checked while no op comes


def rank_main(spec_dict: dict[str, Any]) -> None:
    """Entry point of a rank process (multiprocessing's spawn context)."""
    spec = RankSpec(**spec_dict)
    setproctitle(f"lmd: {spec.name}")
    die_with_parent(spec.leader_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops it
    configure_logging(spec.config.log_level, spec.name)
    exit_without_teardown(RankProcess(spec).run())


class RankProcess:
    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.memory: PoolMemory | None = None
        self.copier: Copier | None = None
        self.ledger: PoolLedger | None = None  # on a GPU: its budget in the device's plan
        self.plan: dict[str, Any] = {}  # that budget and the weights it loaded (status)

    def run(self) -> int:
        spec = self.spec
        ctx = zmq.Context()
        ops = ctx.socket(zmq.PULL)
        ops.setsockopt(zmq.MAXMSGSIZE, MAX_OP_BYTES)
        ops.connect(spec.endpoints.rank_ops(spec.group.name, spec.rank))
        self.replies = ctx.socket(zmq.PUSH)
        self.replies.setsockopt(zmq.LINGER, 1000)
        self.replies.connect(spec.endpoints.rank_replies(spec.group.name))
        try:
            runner = self._build()
        except Exception as exc:
            log.exception("%s cannot start", spec.name)
            self._reply({"op": "failed", "error": _one_line(exc)})
            return 1
        self._reply({"op": "ready", "pid": os.getpid(), "device": spec.device, **self.plan})
        try:
            self._serve(ops, runner)
        except Exception as exc:
            log.exception("%s failed; its group restarts", spec.name)
            self._reply({"op": "failed", "error": _one_line(exc)})
            return 1
        finally:
            if self.copier is not None:
                self.copier.close()
            if self.memory is not None:
                self.memory.close()
            if self.ledger is not None:
                self.ledger.remove(spec.own.name)
        ctx.destroy(linger=1000)
        return 0

    def _build(self) -> RankRunner:
        spec, config = self.spec, self.spec.config
        device = torch.device(spec.device)
        engine_config = config.engine_on(spec.device)
        if device.type == "cuda":  # its part of its GPU's plan, as every engine there
            torch.cuda.set_device(device)
            budget, self.ledger = claim_gpu_budget(
                spec.own, config, engine_config, Path(spec.model_dir)
            )
            cap_allocator(budget, device)
        tp = join_group(
            spec.rank,
            spec.group.tp,
            spec.endpoints.rendezvous(spec.group.name),
            device,
            config.startup_timeout,
        )
        name = spec.group.backend or "auto"
        model_dir = Path(spec.model_dir)
        backend = load_backend(name, model_dir, device, config.dtype, engine_config, tp=tp)
        if device.type == "cuda":
            weights = torch.cuda.memory_allocated(device)
            self.plan = {"memory": {**budget.to_dict(), "weight_bytes": weights}}
        if spec.transport is None:
            return RankRunner(backend)
        memory = self.memory = pool_memory(spec.device, spec.transport)

        def engine_pool(pool: Any) -> None:
            memory.attach(pool)
            self._reply({"op": "pool"}, [memory.descriptor])
            if spec.group.role == Role.PREFILL:
                stream = (
                    torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
                )
                layout = BlockLayout.of(pool, spec.group.tp)
                shard = Shard(spec.rank, spec.group.tp)
                self.copier = Copier(memory.transport, memory.region, layout, shard, stream)

        return RankRunner(backend, memory.buffer, engine_pool)

    def _serve(self, ops: zmq.Socket[bytes], runner: RankRunner) -> None:
        while True:
            busy = self.copier is not None and self.copier.busy
            if busy and not ops.poll(COPY_POLL_MS):
                self._copies_done()
                continue
            header, frames = decode_op(ops.recv_multipart())
            op = header["op"]
            if op == "stop":
                return
            if op == "copy":
                if self.copier is None:
                    raise ValueError("a copy op before this rank's prefill pool exists")
                self.copier.submit(header, _split(frames[0], header["sizes"]))
            else:
                runner.run(header, frames)
            self._copies_done()

    def _copies_done(self) -> None:
        if self.copier is not None:
            for reply in self.copier.poll():
                self._reply(reply)

    def _reply(self, header: dict[str, Any], frames: list[bytes] | None = None) -> None:
        self.replies.send_multipart(encode_op({**header, "rank": self.spec.rank}, frames or ()))


def _split(joined: bytes, sizes: list[int]) -> list[bytes]:
    """Descriptors sent as one frame, by their lengths."""
    out, at = [], 0
    for size in sizes:
        out.append(joined[at : at + size])
        at += size
    if at != len(joined):
        raise ValueError("descriptor lengths do not add up to their frame")
    return out


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
