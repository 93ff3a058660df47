"""`lmd-bench ipc [--messages N] [--round-trips N] [--json]`

Measures the internal wire path (protocol encode + ZeroMQ ipc + decode) between two
real processes: one-way messages per second (PUSH -> PULL, decoded on arrival) and the
round-trip latency of one message there and back.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from lmd import protocol

# A heartbeat as an engine worker sends it: a realistic control-path message.
SAMPLE = protocol.Heartbeat(
    "decode-0", 12, 0, {"rss_bytes": 1 << 30, "kv": {"total_blocks": 4096, "free_blocks": 1000}}
)


def _peer(to_peer: str, from_peer: str, num_messages: int) -> None:
    """Say hello, decode num_messages, say so, then echo every message until Stop."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(to_peer)
    push.connect(from_peer)
    push.send_multipart(protocol.encode(SAMPLE))
    for _ in range(num_messages):
        protocol.decode(pull.recv_multipart())
    push.send_multipart(protocol.encode(SAMPLE))
    while not isinstance(msg := protocol.decode(pull.recv_multipart()), protocol.Stop):
        push.send_multipart(protocol.encode(msg))
    pull.close(0)
    push.close(0)
    ctx.term()


def measure_ipc(num_messages: int, num_round_trips: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lmdb-") as tmp:
        to_peer, from_peer = (f"ipc://{Path(tmp) / n}" for n in ("to.ipc", "from.ipc"))
        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(to_peer)
        pull.bind(from_peer)
        peer = multiprocessing.get_context("spawn").Process(
            target=_peer, args=(to_peer, from_peer, num_messages)
        )
        peer.start()
        protocol.decode(pull.recv_multipart())  # the peer is up: start the clock
        start = time.perf_counter()
        for _ in range(num_messages):
            push.send_multipart(protocol.encode(SAMPLE))
        protocol.decode(pull.recv_multipart())  # the peer decoded them all
        one_way_s = time.perf_counter() - start
        rtt_us = []
        for _ in range(num_round_trips):
            t0 = time.perf_counter()
            push.send_multipart(protocol.encode(SAMPLE))
            protocol.decode(pull.recv_multipart())
            rtt_us.append((time.perf_counter() - t0) * 1e6)
        push.send_multipart(protocol.encode(protocol.Stop()))
        peer.join(10)
        push.close(0)
        pull.close(0)
        ctx.term()
    quantiles = statistics.quantiles(rtt_us, n=100)
    return {
        "benchmark": "ipc",
        "messages": num_messages,
        "message_bytes": sum(len(f) for f in protocol.encode(SAMPLE)),
        "seconds": round(one_way_s, 4),
        "messages_per_s": round(num_messages / one_way_s),
        "round_trips": num_round_trips,
        "rtt_us": {
            "p50": round(statistics.median(rtt_us), 1),
            "p99": round(quantiles[98], 1),
            "mean": round(statistics.fmean(rtt_us), 1),
        },
    }


def add_parser(sub: Any) -> None:
    ipc = sub.add_parser("ipc", help="wire protocol over ZeroMQ ipc between two processes")
    ipc.add_argument("--messages", type=int, default=200_000)
    ipc.add_argument("--round-trips", type=int, default=5_000)
    ipc.add_argument("--json", action="store_true", help="print one JSON line")
    ipc.set_defaults(run=run)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.messages < 1 or args.round_trips < 2:
        raise ValueError("--messages must be >= 1 and --round-trips >= 2")
    return measure_ipc(args.messages, args.round_trips)


def summary(result: dict[str, Any]) -> str:
    rtt = result["rtt_us"]
    return (
        f"one way: {result['messages_per_s']:,} messages/s "
        f"({result['messages']:,} x {result['message_bytes']} B in {result['seconds']} s)\n"
        f"round trip: p50 {rtt['p50']} us, p99 {rtt['p99']} us, mean {rtt['mean']} us "
        f"over {result['round_trips']:,}"
    )
