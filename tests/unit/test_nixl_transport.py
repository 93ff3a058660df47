"""lmd.migration.nixl: NIXL (UCX) moving KV blocks between real processes.

The decode side registers a pool and hands its descriptor (hex text) to the other
process; the prefill side opens it and writes scattered blocks. Each two-process test
runs over TCP (UCX_TLS=tcp) and over shared memory (UCX_TLS=shm,tcp: the writes go
through cma, process_vm_writev; UCX keeps tcp for connection set-up and notifications
because it refuses the shm transports alone when it must detect a dead peer, which the
transport asks of it; on a GPU host NIXL also wants cuda_copy in the list). Spawned
children inherit UCX_TLS. The NIXL tests skip where NIXL is not installed (`pip install
lmd[cluster]`); the checks of the missing-install message and of the option run
everywhere.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from lmd.cli import _parser, build_config
from lmd.config import ConfigError, ServeConfig
from lmd.migration import nixl
from lmd.migration.native import block_copies
from lmd.migration.nixl import NixlTransport, descriptor
from lmd.migration.transports import pool_memory

needs_nixl = pytest.mark.skipif(
    not nixl.available(), reason="NIXL is not installed (pip install lmd[cluster])"
)

BLOCK = 64 << 10  # bytes per KV block
SENTINEL = 0xEE
CHILD_TIMEOUT_S = 60.0
WAIT_S = 30.0  # the longest any copy here may take


def _tls(transports: str) -> str:
    """UCX_TLS for host memory here: NIXL refuses one without cuda_copy on a GPU host."""
    return transports + (",cuda_copy" if torch.cuda.is_available() else "")


@pytest.fixture(params=["tcp", "shm,tcp"], ids=["tcp", "shm"])
def ucx_tls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("UCX_TLS", _tls(request.param))
    return str(request.param)


class Child:
    """A spawned process talking over a duplex pipe; killed if the test leaves it."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(theirs, *args), daemon=True)
        self.process.start()
        theirs.close()

    def recv(self) -> Any:
        assert self.conn.poll(CHILD_TIMEOUT_S), "the child sent nothing"
        status, payload = self.conn.recv()
        assert status == "ok", payload
        return payload

    def close(self) -> None:
        self.process.join(timeout=CHILD_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for child in made:
        if child.process.is_alive():
            child.process.kill()
        child.process.join()


# ----------------------------------------------------------------------------- children


def _prefill(conn: Connection, descriptor_hex: str, seed: int, batches: list[Any]) -> None:
    """Fill a source pool from `seed`; write each batch of (src_ids, dst_ids) as one
    submit with a notification; report the bytes moved, then wait for "bye"."""
    try:
        transport = NixlTransport()
        peer = transport.open(bytes.fromhex(descriptor_hex))
        num_src = 1 + max(max(src) for src, _ in batches)
        src = transport.create_region(num_src * BLOCK)
        src[:] = random.Random(seed).randbytes(num_src * BLOCK)
        moved = []
        for i, (src_ids, dst_ids) in enumerate(batches):
            ticket = transport.submit(
                src, peer, block_copies(src_ids, dst_ids, BLOCK), notify=b"batch %d" % i
            )
            assert ticket.wait(WAIT_S), "a copy did not finish"
            moved.append(ticket.nbytes)
        conn.send(("ok", (transport.agent_name, moved)))
        conn.poll(CHILD_TIMEOUT_S)  # the parent reads its notifications meanwhile
        peer.close()
        src.close()
        transport.close()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _decode(conn: Connection, nbytes: int) -> None:
    """Register a pool, send its descriptor and pid, then wait to be killed."""
    try:
        transport = NixlTransport()
        pool = transport.create_region(nbytes)
        conn.send(("ok", (pool.descriptor().hex(), os.getpid())))
        conn.poll(CHILD_TIMEOUT_S)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


# ----------------------------------------------------------------------------- tests


def _scattered(num_src: int, num_dst: int, seed: int) -> tuple[list[int], list[int]]:
    """Source blocks 0..num_src-1 to distinct random destination blocks, with one run
    consecutive on both sides (merged into one range by block_copies)."""
    rng = random.Random(seed)
    dst = rng.sample(range(num_dst), num_src)
    run = rng.randrange(num_dst - 8)
    dst = [b for b in dst if not run <= b < run + 4][: num_src - 4]
    src = list(range(num_src))
    return src, [*dst[:2], *range(run, run + 4), *dst[2:]]


@needs_nixl
def test_moves_exact_bytes_with_scattered_blocks(ucx_tls: str, children: list[Child]) -> None:
    num_dst, seed = 97, 7  # an odd pool size on purpose
    transport = NixlTransport()
    pool = transport.create_region(num_dst * BLOCK)
    pool[:] = bytes([SENTINEL]) * len(pool)
    src_ids, dst_ids = _scattered(40, num_dst, seed)
    assert len(block_copies(src_ids, dst_ids, BLOCK)) < len(src_ids)  # a run merged
    batches = [(src_ids[:25], dst_ids[:25]), (src_ids[25:], dst_ids[25:])]
    child = Child(_prefill, pool.descriptor().hex(), seed, batches)
    children.append(child)
    sender, moved = child.recv()
    assert moved == [25 * BLOCK, 15 * BLOCK]

    source = random.Random(seed).randbytes(len(src_ids) * BLOCK)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert pool[d * BLOCK : (d + 1) * BLOCK] == source[s * BLOCK : (s + 1) * BLOCK], d
    untouched = set(range(num_dst)) - set(dst_ids)
    for d in untouched:
        assert pool[d * BLOCK : (d + 1) * BLOCK].count(SENTINEL) == BLOCK, d

    received: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 10
    while len(received) < 2 and time.monotonic() < deadline:
        received += transport.notifications()
        time.sleep(0.01)
    assert sorted(received) == [(sender, b"batch 0"), (sender, b"batch 1")]
    child.conn.send("bye")
    child.close()
    pool.close()
    transport.close()


@needs_nixl
def test_peer_killed_mid_transfer_fails_cleanly(ucx_tls: str, children: list[Child]) -> None:
    """SIGKILL of the receiving process during a 512 MiB write: the ticket raises
    RuntimeError (UCX reports the disconnect), within seconds; writes to the dead peer
    fail the same way, and the transport goes on working for everything else."""
    nbytes = 512 << 20
    child = Child(_decode, nbytes)
    children.append(child)
    descriptor_hex, pid = child.recv()
    transport = NixlTransport()
    peer = transport.open(bytes.fromhex(descriptor_hex))
    src = transport.create_region(nbytes)
    assert transport.submit(src, peer, [(0, 0, BLOCK)]).wait(WAIT_S)  # connected
    blocks = list(range(nbytes // BLOCK))
    copies = block_copies(blocks, random.Random(1).sample(blocks, len(blocks)), BLOCK)

    # The shm write runs inside submit (cma copies in the calling thread, GIL released):
    # the kill comes from a timer thread, 20 ms into the copy.
    killer = threading.Timer(0.02, os.kill, (pid, signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    with pytest.raises(RuntimeError, match="nixl write"):
        transport.submit(src, peer, copies).wait(WAIT_S)
    assert time.monotonic() - start < 10
    killer.join()
    child.process.join(10)
    assert child.process.exitcode == -signal.SIGKILL

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="nixl write"):
        transport.submit(src, peer, [(0, 0, BLOCK)]).wait(WAIT_S)
    assert time.monotonic() - start < 10
    peer.close()

    other = transport.create_region(4 * BLOCK)  # the agent still works
    src[: 2 * BLOCK] = os.urandom(2 * BLOCK)
    assert transport.submit(src, transport.open(other.descriptor()), [(0, BLOCK, 2 * BLOCK)]).wait(
        WAIT_S
    )
    assert other[BLOCK : 3 * BLOCK] == src[: 2 * BLOCK]
    transport.close()


@needs_nixl
def test_stopped_peer_times_out_and_close_does_not_hang(
    monkeypatch: pytest.MonkeyPatch, children: list[Child]
) -> None:
    """A receiver that stops (SIGSTOP) but does not die, over TCP: its socket fills, the
    write neither ends nor fails; wait() returns False at its timeout and close() still
    returns promptly with the write in flight."""
    monkeypatch.setenv("UCX_TLS", _tls("tcp"))
    nbytes = 256 << 20
    child = Child(_decode, nbytes)
    children.append(child)
    descriptor_hex, pid = child.recv()
    transport = NixlTransport()
    peer = transport.open(bytes.fromhex(descriptor_hex))
    src = transport.create_region(nbytes)
    assert transport.submit(src, peer, [(0, 0, BLOCK)]).wait(WAIT_S)
    os.kill(pid, signal.SIGSTOP)
    try:
        ticket = transport.submit(src, peer, [(0, 0, nbytes)])
        start = time.monotonic()
        assert ticket.wait(1.0) is False
        assert time.monotonic() - start < 3
        start = time.monotonic()
        transport.close()
        assert time.monotonic() - start < 10
        with pytest.raises(RuntimeError, match="closed"):
            ticket.poll()
    finally:
        os.kill(pid, signal.SIGKILL)


@needs_nixl
def test_checks_every_copy_and_descriptor_before_moving_bytes() -> None:
    transport = NixlTransport()
    src = transport.create_region(8 * BLOCK)
    dst = transport.create_region(4 * BLOCK)
    peer = transport.open(dst.descriptor())  # loopback: NIXL writes within one agent
    assert peer.size == 4 * BLOCK
    bad = {
        "out of range": [(0, 3 * BLOCK, 2 * BLOCK)],
        "offsets must be >= 0": [(-1, 0, BLOCK)],
        "length >= 1": [(0, 0, 0)],
        "overlap": [(0, 0, 2 * BLOCK), (4 * BLOCK, BLOCK, BLOCK)],
    }
    for message, copies in bad.items():
        with pytest.raises(ValueError, match=message):
            transport.submit(src, peer, copies)
    assert dst.count(0) == len(dst)  # nothing moved
    assert transport.submit(src, peer, []).poll()  # an empty batch is done at once

    good = dst.descriptor()
    for broken in (b"", b"lmd-region", good[:12], good[:20] + b"{" + good[21:]):
        with pytest.raises(ValueError, match="nixl transport descriptor"):
            transport.open(broken)
    for fake in (b'{"agent":1}', b'{"agent":"a","addr":-1,"size":1,"device":0,"mem":"DRAM"}'):
        with pytest.raises(ValueError, match="malformed"):
            transport.open(descriptor.MAGIC + descriptor.HEADER_LEN.pack(len(fake)) + fake + b"x")

    with NixlTransport() as other:  # a second agent: metadata that is not the named agent's
        _, metadata, span = descriptor.parse(good)
        with pytest.raises(ValueError, match="names agent lmd-forged"):
            other.open(descriptor.encode("lmd-forged", metadata, span))
        with pytest.raises(ValueError, match="another nixl transport"):
            other.submit(other.create_region(BLOCK), peer, [(0, 0, BLOCK)])

    src[:BLOCK] = os.urandom(BLOCK)
    assert transport.submit(src, peer, [(0, 2 * BLOCK, BLOCK)]).wait(WAIT_S)
    assert dst[2 * BLOCK : 3 * BLOCK] == src[:BLOCK]
    dst.close()
    with pytest.raises(ValueError, match="closed"):
        dst.descriptor()
    transport.close()
    with pytest.raises(ValueError, match="closed"):
        transport.create_region(BLOCK)


@needs_nixl
def test_pool_memory_on_nixl_is_a_writable_registered_buffer() -> None:
    memory = pool_memory("cpu", "nixl")
    assert memory.transport.name == "nixl" and memory.kind == "host"
    view = memory.buffer(3 * BLOCK)
    assert isinstance(view, memoryview) and len(view) == 3 * BLOCK and not view.readonly
    view[:4] = b"kv!!"
    peer = memory.transport.open(memory.descriptor)
    assert peer.size == 3 * BLOCK
    peer.close()
    view.release()
    memory.close()


def test_without_nixl_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl", None)  # what an interpreter without it sees
    monkeypatch.setitem(sys.modules, "nixl._bindings", None)
    with pytest.raises(RuntimeError) as raised:
        NixlTransport()
    assert str(raised.value).startswith(nixl.INSTALL_HINT)
    assert "\n" not in str(raised.value)
    with pytest.raises(RuntimeError, match="lmd\\[cluster\\]"):
        pool_memory("cpu", "nixl")
    with pytest.raises(ValueError, match="native or nixl"):
        pool_memory("cpu", "rdma")


def test_migration_transport_option(tmp_path: Any) -> None:
    args = _parser().parse_args(
        ["serve", "--runtime-dir", str(tmp_path), "--migration-transport", "nixl"]
    )
    assert build_config(args, env={}).migration_transport == "nixl"
    args = _parser().parse_args(["serve", "--runtime-dir", str(tmp_path)])
    assert build_config(args, env={}).migration_transport == "native"
    assert build_config(args, env={"LMD_MIGRATION_TRANSPORT": "nixl"}).migration_transport == (
        "nixl"
    )
    with pytest.raises(ConfigError, match="migration_transport"):
        ServeConfig(runtime_dir=tmp_path, migration_transport="rdma")
