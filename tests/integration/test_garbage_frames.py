"""Garbage on internal ZeroMQ sockets is dropped and counted; nothing crashes."""

from __future__ import annotations

import zmq

from lmd import protocol
from tests.integration.daemon import Daemon, wait_until

GARBAGE: list[list[bytes]] = [
    [b"\x01"],  # one frame only
    [b"", b"{}"],  # empty type frame
    [b"\xff", b"{}"],  # unknown type byte
    [b"\x02", b'{"name": "x", "inflight'],  # truncated header
    [b"\x02", b"[]"],  # header not an object
    [b"\x02", b'{"name": 1, "inflight": 0, "num_dropped": 0, "stats": {}}'],  # wrong type
    [b"\x01\x02", b"{}"],  # two-byte type
]


WORKERS = ["tokenizer-0", "prefill-0", "decode-0", "api-0"]


def test_garbage_to_supervisor_and_every_worker_inbox(daemon: Daemon) -> None:
    before = daemon.status()
    pids = {w["name"]: w["pid"] for w in before["workers"]}
    # A well-formed message that is not for a worker's inbox (a supervisor's Drain).
    unexpected = protocol.encode(protocol.Drain())
    ctx = zmq.Context()
    try:
        sup = ctx.socket(zmq.DEALER)
        sup.setsockopt(zmq.IDENTITY, b"intruder")
        sup.connect(f"ipc://{daemon.runtime_dir}/supervisor.ipc")
        inboxes = []
        for name in WORKERS:
            inbox = ctx.socket(zmq.PUSH)
            inbox.connect(f"ipc://{daemon.runtime_dir}/{name}.ipc")
            inboxes.append(inbox)
        for frames in GARBAGE:
            sup.send_multipart(frames)
            for inbox in inboxes:
                inbox.send_multipart(frames)
        for inbox in inboxes:
            inbox.send_multipart(unexpected)
        # A well-formed message from a peer that is not one of our workers.
        sup.send_multipart([b"\x02", b'{"name":"x","inflight":0,"num_dropped":0,"stats":{}}'])
        n = len(GARBAGE)
        wait_until(lambda: daemon.status()["num_dropped"] == n + 1, 10, "supervisor drops")
        for name in WORKERS:
            wait_until(
                lambda name=name: daemon.worker(name)["num_dropped"] == n + 1,  # type: ignore[misc]
                10,
                f"{name} inbox drops",
            )
        sup.close(0)
        for inbox in inboxes:
            inbox.close(0)
    finally:
        ctx.term()
    after = daemon.status()
    assert after["state"] == "running"
    assert {w["name"]: w["pid"] for w in after["workers"]} == pids
    assert all(w["restarts"] == 0 for w in after["workers"])
