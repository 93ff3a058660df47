"""Two hosts, one cluster (issue 10): network namespaces joined by a bridge
(tests/netns.py), etcd on host a, `lmdd serve --cluster` nodes:
  host a: api + tokenizer + prefill;   host b: decode;   host c: a node with another key.

- greedy and seeded SmolLM2 outputs through host a equal a single-host hybrid daemon's,
  each prompt's KV crossing hosts over NIXL (UCX over TCP), internal messages over
  CURVE-authenticated ZeroMQ TCP; `lmdctl status` on a shows both nodes;
- kill -9 of b's decode worker with streams in flight: they end with a clear error, new
  requests fail clearly (503) until b's supervisor has it back, then succeed; nothing
  leaks on either host;
- b's whole node dies (kill -9 of its supervisor): a stops routing to it within the
  lease TTL (/health 503 naming decode) and takes it back when b returns;
- host c, whose key is not the cluster's, cannot join: each side ignores the other's
  record, and a message c sends straight to a's inbox is refused and logged.
Skipped (with the reason) without root network namespaces, etcd, aetcd or NIXL.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from lmd import protocol
from lmd.migration import nixl
from tests.etcd_server import EtcdServer, etcd_binary
from tests.integration.daemon import Daemon, wait_until
from tests.integration.test_migration import (
    ENGINE,
    MODEL,
    PROMPTS,
    idle_and_leak_free,
    kill_decode_during_migrations,
    outputs,
)
from tests.netns import Host, hosts, skip_reason


def _why_skip() -> str | None:
    if etcd_binary() is None:
        return "etcd is not installed (Debian: apt-get install etcd-server)"
    if not nixl.available():
        return "NIXL is not installed (pip install lmd[cluster])"
    try:
        import aetcd  # noqa: F401
    except ImportError:
        return "aetcd is not installed (pip install lmd[cluster])"
    return None


pytestmark = pytest.mark.skipif(_why_skip() is not None, reason=str(_why_skip()))
LMDCTL = [sys.executable, "-m", "lmd_client.lmdctl"]
needs_netns = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


def node(host: Host, etcd: EtcdServer, key: Path, roles: str, *extra: str) -> Daemon:
    return Daemon(
        *ENGINE,
        "--cluster",
        etcd.url,
        "--cluster-key",
        str(key),
        "--node-name",
        host.name,
        "--roles",
        roles,
        "--migration-transport",
        "nixl",
        *extra,
        host=host,
    )


def healthy(daemon: Daemon) -> bool:
    try:
        return httpx.get(f"{daemon.url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def cluster_nodes(daemon: Daemon) -> dict[str, Any]:
    return {n["node"]: n for n in daemon.status()["cluster"]["nodes"]}


@needs_netns
@pytest.mark.timeout(900)
def test_two_hosts_serve_as_one_and_survive_losing_decode(tmp_path: Path) -> None:
    reference = Daemon("--mode", "hybrid", *ENGINE)
    try:
        reference.start()
        expected = outputs(reference)
    finally:
        reference.close()

    key, other_key = tmp_path / "cluster.key", tmp_path / "other.key"
    from lmd.cluster.keys import ClusterKey

    ClusterKey.generate().save(key)
    ClusterKey.generate().save(other_key)
    with hosts("a", "b", "c") as h:
        etcd = EtcdServer(tmp_path, host=h["a"])
        etcd.start()
        a = node(h["a"], etcd, key, "api,tokenizer,prefill")
        b = node(h["b"], etcd, key, "decode")
        c = node(h["c"], etcd, other_key, "decode")
        try:
            a.start()
            b.start()
            wait_until(lambda: healthy(a), 60, "host a healthy with b's decode")
            _serve_across_hosts(a, b, expected)
            names = {r: f"{r}-0@a" for r in ("tokenizer", "prefill", "api")}
            kill_decode_during_migrations(a, b, {**names, "decode": "decode-0@b"})
            _lose_and_regain_node_b(a, b)
            _intruder_cannot_join(a, c, other_key)
        finally:
            for daemon in (c, b, a):
                daemon.close()
            etcd.stop()


def _serve_across_hosts(a: Daemon, b: Daemon, expected: dict[str, Any]) -> None:
    assert outputs(a) == expected
    nodes = cluster_nodes(a)
    assert set(nodes) == {"a", "b"}
    decode = {w["name"]: w for w in nodes["b"]["workers"]}["decode-0@b"]
    assert decode["endpoint"].startswith(f"tcp://{b.host.address}:")  # type: ignore[union-attr]
    total = 2 * len(PROMPTS)
    # Worker stats travel on heartbeats (every second): wait for ones that count them all.
    wait_until(
        lambda: (
            a.worker("prefill-0@a")["migration"]["count"] >= total
            and b.worker("decode-0@b")["migration"]["received"] >= total
        ),
        10,
        "heartbeats counting every migration",
    )
    prefill = a.worker("prefill-0@a")
    assert prefill["transport"] == "nixl"
    assert prefill["migration"]["count"] == total and prefill["migration"]["failures"] == 0
    assert b.worker("decode-0@b")["migration"]["received"] == total
    idle_and_leak_free(a, ["prefill-0@a"])
    idle_and_leak_free(b, ["decode-0@b"])
    table = subprocess.run(
        [*LMDCTL, "--socket", str(a.socket_path), "status"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert table.returncode == 0, table.stderr
    assert "cluster etcd://" in table.stdout and "connected; this node: a" in table.stdout
    rows = {line.split()[2]: line.split() for line in table.stdout.splitlines() if "@" in line}
    assert {"tokenizer-0@a", "prefill-0@a", "api-0@a", "decode-0@b"} <= set(rows)
    assert rows["decode-0@b"][:2] == ["b", "running"]


def _lose_and_regain_node_b(a: Daemon, b: Daemon) -> None:
    """b's supervisor killed: its workers die with it (PDEATHSIG), its lease expires."""
    assert b.proc is not None
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(10)
    wait_until(lambda: not healthy(a), 10, "a to drop b's decode worker (its lease expired)")
    assert "b" not in cluster_nodes(a)
    health = httpx.get(f"{a.url}/health", timeout=5)
    assert health.status_code == 503 and "decode" in health.json()["reason"]
    refused = httpx.post(
        f"{a.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}
    )
    assert refused.status_code == 503 and "decode" in refused.json()["error"]["message"]
    b.start()  # the same node comes back: routed to again
    wait_until(lambda: healthy(a), 60, "host a healthy once b is back")
    again = httpx.post(
        f"{a.url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": "The capital of France is",
            "max_tokens": 4,
            "ignore_eos": True,  # the default temperature of 1 may sample EOS early
        },
        timeout=60,
    )
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["completion_tokens"] == 4


def _intruder_cannot_join(a: Daemon, c: Daemon, other_key: Path) -> None:
    c.start()
    wait_until(lambda: "ignoring node c" in a.log(), 30, "a to ignore c's record")
    assert "ignoring node a" in c.log()
    assert "c" not in cluster_nodes(a)
    # c cannot reach a's workers either: a message straight to a's prefill inbox, sent
    # with c's key, is refused and logged (the pytest process plays c here).
    from lmd.cluster import links
    from lmd.cluster.keys import ClusterKey

    nodes = cluster_nodes(a)
    endpoint = {w["name"]: w for w in nodes["a"]["workers"]}["prefill-0@a"]["endpoint"]
    ctx = zmq.asyncio.Context()
    try:
        push = links.connect_push(ctx, endpoint, "intruder", ClusterKey.load(other_key))
        push.try_send(protocol.Abort("intruder-request"))
        wait_until(lambda: a.worker("prefill-0@a").get("num_refused", 0) >= 1, 15, "a refusal")
        assert "refused a connection" in a.log()
        push.close()
    finally:
        ctx.term()
    for i in range(3):  # the cluster serves on, untouched
        ok = httpx.post(
            f"{a.url}/v1/completions",
            json={"model": MODEL, "prompt": f"still {i}", "max_tokens": 3},
            timeout=60,
        )
        assert ok.status_code == 200, ok.text


def test_a_node_that_cannot_join_says_why(tmp_path: Path) -> None:
    """A taken node name, an etcd that does not answer, a key file others can read: one
    line each, and no worker started."""
    from lmd.cluster.keys import ClusterKey

    key = tmp_path / "cluster.key"
    ClusterKey.generate().save(key)
    with EtcdServer(tmp_path) as etcd:
        args = ("--cluster", etcd.url, "--cluster-key", str(key), "--node-name", "x")
        first = Daemon(*args, "--migration-transport", "nixl", "--roles", "api")
        second = Daemon(*args, "--migration-transport", "nixl", "--roles", "api")
        try:
            first.start()
            second.start(wait=False)
            assert second.wait_exit(30) == 1
            assert "node name x is already registered by pid" in second.log()
            assert not second.child_pids()
        finally:
            first.close()
            second.close()
    nowhere = Daemon(*args, "--migration-transport", "nixl", "--roles", "api")
    nowhere.start(wait=False)
    assert nowhere.wait_exit(30) == 1  # etcd is gone now
    assert f"cannot reach etcd at {etcd.host}:{etcd.port}" in nowhere.log()
    nowhere.close()
    key.chmod(0o644)
    open_key = Daemon(*args, "--migration-transport", "nixl")
    open_key.start(wait=False)
    assert open_key.wait_exit(30) == 2
    assert "chmod 600" in open_key.log()
    open_key.close()
