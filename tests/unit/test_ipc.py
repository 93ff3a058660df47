"""Channel.try_send reports a full queue (the asyncio socket alone hides it)."""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.asyncio

from lmd import ipc, protocol


async def test_try_send_says_false_when_the_peer_is_not_reading(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    try:
        channel = ipc.connect_push(ctx, f"ipc://{tmp_path}/nobody.ipc", "test")
        channel.socket.setsockopt(zmq.SNDHWM, 2)
        results = [channel.try_send(protocol.Abort(f"r{i}")) for i in range(10)]
        assert results[0] is True
        assert results.count(False) >= 5  # queued up to the high-water mark, then refused
        channel.close()
    finally:
        ctx.term()
