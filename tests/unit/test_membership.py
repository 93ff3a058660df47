"""Cluster membership through a real etcd: join, see each other, leave, die, survive outages.

The tests that need etcd start one of their own (tests/etcd_server.py) and skip, saying
why, where the `etcd` binary or the `aetcd` client is missing. A "killed" node runs in a
child process that the test SIGKILLs, so that nothing revokes its lease.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from lmd.cluster.membership import Membership, MembershipError, NodeRecord, parse_etcd_url
from lmd.cluster.records import NodeRecords, seal, unseal
from tests.etcd_server import EtcdServer, etcd_binary, free_port

SECRET = b"cluster secret for tests"
TTL_S = 2.0  # etcd's lease granularity is 1 s; 2 s leaves room for a busy machine


def record(node: str, state: str = "running", **workers: dict[str, object]) -> NodeRecord:
    return NodeRecord(node, "127.0.0.1", os.getpid(), state, dict(workers))


async def until(condition: Callable[[], bool], timeout_s: float = 15.0) -> float:
    """Poll until condition holds; fail after timeout_s. Returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    if importlib.util.find_spec("aetcd") is None:
        pytest.skip("the aetcd client is not installed (pip install 'lmd[cluster]')")
    with EtcdServer(tmp_path) as server:
        yield server


@pytest.fixture
async def members(etcd: EtcdServer) -> AsyncIterator[list[Membership]]:
    """Memberships a test makes (append them); all stopped at the end."""
    made: list[Membership] = []
    yield made
    for m in made:
        await m.stop()


async def join(
    made: list[Membership], etcd: EtcdServer, node: str, secret: bytes = SECRET
) -> Membership:
    m = Membership(etcd.url, node, secret, ttl_s=TTL_S)
    made.append(m)
    await m.start(record(node))
    return m


# A node in its own process, so that SIGKILL leaves its lease to expire.
CHILD = textwrap.dedent(
    """
    import asyncio, os, sys
    from lmd.cluster.membership import Membership, NodeRecord

    async def main() -> None:
        url, node, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
        m = Membership(url, node, sys.argv[4].encode(), ttl_s=ttl)
        await m.start(NodeRecord(node, "127.0.0.1", os.getpid(), "running", {}))
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


async def spawn_node(etcd: EtcdServer, node: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", CHILD, etcd.url, node, str(TTL_S), SECRET.decode()]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        assert line.strip() == "ready", f"child node {node} did not start"
    except BaseException:
        child.kill()
        child.wait()
        raise
    return child


# -- records and arguments: no etcd needed


def test_a_record_round_trips_and_only_its_secret_opens_it() -> None:
    r = record("a", decode_0={"role": "decode", "pid": 7, "load": 0.5})
    assert NodeRecord.from_json(r.to_json()) == r
    assert unseal(seal(r, SECRET), SECRET) == r
    with pytest.raises(ValueError, match="not signed with this cluster's key"):
        unseal(seal(r, b"another cluster"), SECRET)


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[1]",
        b'{"node": "a"}',
        b'{"node": "a/b", "host": "h", "pid": 1, "state": "running", "workers": {}}',
        b'{"node": "a", "host": "h", "pid": "1", "state": "running", "workers": {}}',
        b'{"node": "a", "host": "h", "pid": 1, "state": "running", "workers": []}',
    ],
)
def test_a_malformed_record_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        NodeRecord.from_json(data)


def test_a_bad_value_is_left_out_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    seen = NodeRecords("/p/", SECRET)
    changes: list[int] = []
    seen.on_change(lambda: changes.append(1))
    seen.put(b"/p/a", seal(record("a"), SECRET))
    seen.put(b"/p/b", b"garbage")
    seen.put(b"/p/b", b"more garbage")
    seen.put(b"/p/c", seal(record("a"), SECRET))  # a's record under c's key
    assert set(seen.records) == {"a"}
    assert len(changes) == 1
    assert caplog.text.count("ignoring node b in etcd") == 1
    assert "ignoring node c in etcd: its record is for node a" in caplog.text
    seen.replace({b"/p/b": seal(record("b"), SECRET)})  # a full read: a is gone
    assert set(seen.records) == {"b"}
    seen.delete(b"/p/b")
    assert seen.records == {}


@pytest.mark.parametrize(
    "url", ["http://h:2379", "etcd://h", "etcd://h:0", "etcd://h:70000", "etcd://:1"]
)
def test_a_cluster_address_must_be_etcd_host_port(url: str) -> None:
    with pytest.raises(ValueError, match="is not etcd://HOST:PORT"):
        Membership(url, "a", SECRET)
    assert parse_etcd_url("etcd://10.0.0.5:2379") == ("10.0.0.5", 2379)


def test_a_node_name_is_checked() -> None:
    with pytest.raises(ValueError, match="node name"):
        Membership("etcd://h:2379", "a.b", SECRET)


async def test_an_unreachable_etcd_is_refused_in_a_few_seconds() -> None:
    pytest.importorskip("aetcd", reason="the aetcd client is not installed")
    port = free_port()  # nothing listens there
    m = Membership(f"etcd://127.0.0.1:{port}", "a", SECRET)
    start = time.monotonic()
    with pytest.raises(MembershipError, match=f"cannot reach etcd at 127.0.0.1:{port}: "):
        await m.start(record("a"))
    assert time.monotonic() - start < 10
    await m.stop()


# -- with etcd


async def test_two_nodes_see_each_other_and_published_records(
    etcd: EtcdServer, members: list[Membership]
) -> None:
    a = await join(members, etcd, "a")
    b = await join(members, etcd, "b")
    assert set(b.view) == {"a", "b"}  # start() returns with the view read
    await until(lambda: set(a.view) == {"a", "b"})
    assert a.connected and b.connected
    changes: list[int] = []
    a.on_change(lambda: changes.append(1))
    b.publish(record("b", "draining", prefill_0={"role": "prefill", "endpoint": "tcp://x:1"}))
    await until(lambda: a.view["b"].state == "draining")
    assert a.view["b"].workers == {"prefill_0": {"role": "prefill", "endpoint": "tcp://x:1"}}
    assert changes


async def test_a_burst_of_publishes_is_one_put(etcd: EtcdServer, members: list[Membership]) -> None:
    a = await join(members, etcd, "a")
    b = await join(members, etcd, "b")
    puts: list[str] = []
    b.on_change(lambda: puts.append(b.view["a"].state))
    for i in range(50):
        a.publish(record("a", f"state{i}"))
    await until(lambda: b.view["a"].state == "state49")
    await asyncio.sleep(0.5)
    assert puts == ["state49"]  # the 49 before it were never put


async def test_a_taken_node_name_is_refused(etcd: EtcdServer, members: list[Membership]) -> None:
    await join(members, etcd, "a")
    second = Membership(etcd.url, "a", SECRET, ttl_s=TTL_S)
    expected = f"node name a is already registered by pid {os.getpid()} on host 127.0.0.1"
    with pytest.raises(MembershipError, match=expected):
        await second.start(record("a"))
    await second.stop()


async def test_a_node_without_the_cluster_key_is_ignored(
    etcd: EtcdServer, members: list[Membership], caplog: pytest.LogCaptureFixture
) -> None:
    a = await join(members, etcd, "a")
    c = await join(members, etcd, "c", secret=b"not this cluster's secret")
    c.publish(record("c", "draining"))
    await until(lambda: c.view.get("c", record("c")).state == "draining")
    a.publish(record("a", "draining"))  # seen after c's puts: watch events come in order
    await until(lambda: a.view["a"].state == "draining")
    assert set(a.view) == {"a"}
    expected = "ignoring node c in etcd: its record is not signed with this cluster's key"
    assert caplog.text.count(expected) == 1


async def test_a_stopped_node_leaves_at_once_and_leaves_no_task(
    etcd: EtcdServer, members: list[Membership]
) -> None:
    before = asyncio.all_tasks()
    a = await join(members, etcd, "a")
    b = Membership(etcd.url, "b", SECRET, ttl_s=10)  # expiry alone would take 10 s
    await b.start(record("b"))
    await until(lambda: "b" in a.view)
    changes: list[int] = []
    a.on_change(lambda: changes.append(1))
    await b.stop()
    took = await until(lambda: "b" not in a.view)
    assert took < 3, f"a saw b leave after {took:.1f} s"
    assert changes
    assert not b.connected
    await b.stop()  # a second stop does nothing
    assert not [t for t in asyncio.all_tasks() if t.get_name().endswith("-b")]
    await a.stop()
    # Nothing of either is left running, the gRPC client's own tasks included.
    await until(lambda: not asyncio.all_tasks() - before, timeout_s=5)


async def test_a_killed_node_is_dropped_when_its_lease_expires(
    etcd: EtcdServer, members: list[Membership]
) -> None:
    a = await join(members, etcd, "a")
    child = await spawn_node(etcd, "k")
    try:
        await until(lambda: "k" in a.view)
        assert a.view["k"].pid == child.pid
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        took = await until(lambda: "k" not in a.view)
    finally:
        child.kill()
        child.wait()
    # The lease (TTL_S) was refreshed at most TTL_S / 3 before the kill; etcd checks
    # expiry every 0.5 s. A margin for a busy machine on top of that.
    assert took < TTL_S + 3, f"a dropped the killed node after {took:.1f} s"


async def test_an_etcd_outage_keeps_the_view_and_resyncs(
    etcd: EtcdServer, members: list[Membership], caplog: pytest.LogCaptureFixture
) -> None:
    a = await join(members, etcd, "a")
    b = await join(members, etcd, "b")
    await until(lambda: set(a.view) == {"a", "b"})
    etcd.stop()
    await until(lambda: not a.connected and not b.connected)
    assert set(a.view) == {"a", "b"}  # the last known state, not an empty cluster
    assert "membership is stale" in caplog.text
    b.publish(record("b", "draining"))  # put once etcd is back
    await asyncio.sleep(1)
    assert set(a.view) == {"a", "b"}
    etcd.start()  # same data: the leases survive (etcd renews them when it starts)
    await until(lambda: a.connected and b.connected)
    await until(lambda: a.view["b"].state == "draining")
    assert set(a.view) == {"a", "b"}


async def test_an_etcd_that_lost_its_data_gets_our_records_again(
    etcd: EtcdServer, members: list[Membership], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    a = await join(members, etcd, "a")
    b = await join(members, etcd, "b")
    child = await spawn_node(etcd, "k")
    try:
        await until(lambda: set(a.view) == {"a", "b", "k"})
        etcd.stop()
        child.send_signal(signal.SIGKILL)  # dies while etcd is down: no DELETE event for it
        child.wait(timeout=10)
        await until(lambda: not a.connected)
        etcd.restart(wipe=True)
        await until(lambda: a.connected and b.connected)
        # Only a full read of the prefix after the reconnect drops k.
        await until(lambda: set(a.view) == {"a", "b"} and set(b.view) == {"a", "b"})
    finally:
        child.kill()
        child.wait()
    assert "lease lost, registering again" in caplog.text
    b.publish(record("b", "draining"))  # publishing works under the new lease
    await until(lambda: a.view["b"].state == "draining")


async def test_a_lost_lease_is_replaced_and_the_record_put_again(
    etcd: EtcdServer, members: list[Membership], caplog: pytest.LogCaptureFixture
) -> None:
    import aetcd

    a = await join(members, etcd, "a")
    b = await join(members, etcd, "b")
    await until(lambda: "b" in a.view)
    b_seen: list[bool] = []
    a.on_change(lambda: b_seen.append("b" in a.view))
    async with aetcd.Client(etcd.host, etcd.port) as admin:  # `etcdctl lease revoke`
        lease_id = (await admin.get(b"/lmd/nodes/b")).lease
        await admin.revoke_lease(lease_id)
        await until(lambda: b_seen[-2:] == [False, True])  # b left, and registered again
        assert (await admin.get(b"/lmd/nodes/b")).lease != lease_id
    assert "lease lost, registering again" in caplog.text
    assert b.connected
