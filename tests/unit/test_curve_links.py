"""TCP inboxes behind CURVE: members get through, everyone else is refused and logged.

Real sockets on 127.0.0.1 and real protocol messages; waits poll with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from lmd import ipc, protocol
from lmd.cluster import links
from lmd.cluster.keys import ClusterKey

LABEL = "decode-0 inbox"
DEADLINE_S = 15.0  # generous: a 2-core machine with other work running


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A context that the test must leave with no socket open and no task running."""
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
        await _until(lambda: not _other_tasks(), "the gate and monitor tasks to end")
        # term() blocks while any socket of the context is open.
        await asyncio.wait_for(asyncio.to_thread(ctx.term), DEADLINE_S)
    finally:
        if not ctx.closed:
            ctx.destroy(linger=0)


@pytest.fixture
def key() -> ClusterKey:
    return ClusterKey.generate()


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="lmd.cluster.links")
    return caplog


def _other_tasks() -> set[asyncio.Task[object]]:
    return asyncio.all_tasks() - {asyncio.current_task()}


async def _until(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not check():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _recv(channel: ipc.Channel) -> protocol.Message:
    return await asyncio.wait_for(channel.recv(), DEADLINE_S)


async def _nothing_more(channel: ipc.Channel) -> bool:
    """True when no further message comes within a moment."""
    try:
        await asyncio.wait_for(channel.recv(), 0.2)
    except TimeoutError:
        return True
    return False


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "lmd.cluster.links" and r.levelno == logging.WARNING
    ]


def _curve_push(
    ctx: zmq.asyncio.Context, endpoint: str, client: ClusterKey, server_public: bytes
) -> ipc.Channel:
    """A CURVE client with any key pair (links.connect_push only makes members)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, client.secret)
    sock.connect(endpoint)
    return ipc.Channel(sock, "intruder")


def _bind(
    ctx: zmq.asyncio.Context, tmp_path: Path, key: ClusterKey, name: str = "decode-0"
) -> tuple[links.Inbox, str, str]:
    ipc_endpoint = f"ipc://{tmp_path}/{name}.ipc"
    inbox, tcp = links.bind_inbox(ctx, ipc_endpoint, LABEL, "127.0.0.1", key)
    assert tcp is not None
    return inbox, ipc_endpoint, tcp


async def test_members_send_over_tcp_and_same_host_peers_over_plain_ipc(
    ctx: zmq.asyncio.Context, tmp_path: Path, key: ClusterKey
) -> None:
    inbox, ipc_endpoint, tcp = _bind(ctx, tmp_path, key)
    assert tcp.startswith("tcp://127.0.0.1:")
    assert inbox.tcp_endpoint == tcp
    remote = links.connect_push(ctx, tcp, "prefill-0->decode-0", key)
    local = links.connect_push(ctx, ipc_endpoint, "api-0->decode-0", key)  # key unused
    assert remote.socket.getsockopt(zmq.MECHANISM) == zmq.CURVE
    assert local.socket.getsockopt(zmq.MECHANISM) == zmq.NULL

    await remote.send(protocol.Abort("over-tcp"))
    assert await _recv(inbox) == protocol.Abort("over-tcp")
    # The CURVE options set for the tcp listener did not reach the ipc one.
    await local.send(protocol.Abort("over-ipc"))
    assert await _recv(inbox) == protocol.Abort("over-ipc")
    assert inbox.num_refused == 0

    for channel in (remote, local, inbox):
        channel.close()


async def test_an_ipc_only_inbox_has_no_curve_and_no_tasks(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    inbox, tcp = links.bind_inbox(ctx, f"ipc://{tmp_path}/w.ipc", LABEL)
    assert tcp is None
    assert not _other_tasks()
    push = ipc.connect_push(ctx, f"ipc://{tmp_path}/w.ipc", "peer")
    await push.send(protocol.Abort("r1"))
    assert await _recv(inbox) == protocol.Abort("r1")
    assert inbox.num_refused == 0
    push.close()
    inbox.close()


async def test_a_client_with_another_key_pair_is_refused_and_its_address_logged(
    ctx: zmq.asyncio.Context,
    tmp_path: Path,
    key: ClusterKey,
    warnings: pytest.LogCaptureFixture,
) -> None:
    inbox, _, tcp = _bind(ctx, tmp_path, key)
    # It knows the server's public key, so the handshake reaches ZAP, which sees its key.
    intruder = _curve_push(ctx, tcp, ClusterKey.generate(), key.public)
    assert intruder.try_send(protocol.Abort("from-intruder"))
    await _until(lambda: inbox.num_refused >= 1, "the refusal")
    assert any(
        f"from 127.0.0.1 to {LABEL}: it does not hold the cluster key" in m
        for m in _refusals(warnings)
    )

    member = links.connect_push(ctx, tcp, "member", key)
    await member.send(protocol.Abort("from-member"))
    assert await _recv(inbox) == protocol.Abort("from-member")
    assert await _nothing_more(inbox)  # the intruder's message never came in

    for channel in (intruder, member, inbox):
        channel.close()


async def test_a_client_without_curve_is_refused_and_logged(
    ctx: zmq.asyncio.Context,
    tmp_path: Path,
    key: ClusterKey,
    warnings: pytest.LogCaptureFixture,
) -> None:
    inbox, _, tcp = _bind(ctx, tmp_path, key)
    plain = ipc.connect_push(ctx, tcp, "plain")  # a plain ZeroMQ PUSH over TCP
    assert plain.try_send(protocol.Abort("plain"))
    await _until(lambda: inbox.num_refused >= 1, "the refusal")
    logged = _refusals(warnings)
    assert any(tcp in m and LABEL in m and "does not use CURVE" in m for m in logged)
    assert await _nothing_more(inbox)
    plain.close()
    inbox.close()


async def test_a_client_without_the_cluster_key_is_refused_and_the_log_is_rate_limited(
    ctx: zmq.asyncio.Context,
    tmp_path: Path,
    key: ClusterKey,
    warnings: pytest.LogCaptureFixture,
) -> None:
    inbox, _, tcp = _bind(ctx, tmp_path, key)
    # A node with another cluster's key: it encrypts for the wrong server key, the
    # handshake fails before ZAP, and libzmq retries the connection again and again.
    stranger = links.connect_push(ctx, tcp, "stranger", ClusterKey.generate())
    stranger.socket.setsockopt(zmq.RECONNECT_IVL, 5)  # ms; retry fast for the test
    assert stranger.try_send(protocol.Abort("stranger"))
    await _until(lambda: inbox.num_refused >= 15, "15 refusals")
    logged = _refusals(warnings)
    assert len(logged) == 10  # the first ten; then one in a thousand
    assert all("does not hold the cluster key" in m and tcp in m for m in logged)
    assert await _nothing_more(inbox)
    stranger.close()
    inbox.close()


async def test_inboxes_share_their_context_gate_until_the_last_one_closes(
    ctx: zmq.asyncio.Context, tmp_path: Path, key: ClusterKey
) -> None:
    first, _, _ = _bind(ctx, tmp_path, key, "prefill-0")
    second, _, tcp = _bind(ctx, tmp_path, key, "decode-0")
    first.close()
    member = links.connect_push(ctx, tcp, "member", key)  # the gate still answers
    await member.send(protocol.Abort("r1"))
    assert await _recv(second) == protocol.Abort("r1")
    member.close()
    second.close()
    await _until(lambda: not _other_tasks(), "the gate to stop with the last inbox")

    third, _, tcp = _bind(ctx, tmp_path, key, "decode-1")  # a fresh gate binds ZAP again
    member = links.connect_push(ctx, tcp, "member", key)
    await member.send(protocol.Abort("r2"))
    assert await _recv(third) == protocol.Abort("r2")
    member.close()
    third.close()
    third.close()  # closing twice is harmless


async def test_tcp_links_need_the_key(
    ctx: zmq.asyncio.Context, tmp_path: Path, key: ClusterKey
) -> None:
    with pytest.raises(ValueError, match="cluster key"):
        links.connect_push(ctx, "tcp://127.0.0.1:9", "nokey")
    with pytest.raises(ValueError, match="cluster key"):
        links.bind_inbox(ctx, f"ipc://{tmp_path}/w.ipc", LABEL, "127.0.0.1")
    # A failed bind leaves nothing behind (the fixture's term() would hang otherwise).
    with pytest.raises(zmq.ZMQError):
        links.bind_inbox(ctx, f"ipc://{tmp_path}/w.ipc", LABEL, "203.0.113.1", key)
