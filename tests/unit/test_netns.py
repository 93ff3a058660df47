"""tests.netns: fake hosts as network namespaces joined by a bridge.

Each host sees only lo and its eth0 (in `ip` and in /sys, where UCX looks); hosts reach
each other and the pytest process reaches them over TCP and HTTP; teardown leaves no
namespace, link or process, even when the body raised; two uses get two networks; and
NIXL moves 4 MiB from a process in host a into one in host b across b's link. Skipped,
with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import contextlib
import importlib.util
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from tests.netns import Host, hosts, skip_reason

REPO = Path(__file__).resolve().parents[2]
PORT = 7000  # a host's ports are its own: a fixed one never collides
TIMEOUT_S = 30.0
NIXL_BYTES = 4 << 20

# Answers each connection with "<peer address> <what it sent>", until stopped.
ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    conn, (peer, _) = server.accept()
    with conn:
        conn.sendall(peer.encode() + b" " + conn.recv(64))
"""
# Sends "ping" to a server that may still be starting; prints the answer.
CLIENT = """
import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
        break
    except OSError:
        if time.monotonic() >= deadline:
            raise
        time.sleep(0.02)
conn.sendall(b"ping")
print(conn.recv(128).decode())
"""


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def two() -> Iterator[dict[str, Host]]:
    with hosts("a", "b") as made:
        yield made


def connect(address: str, port: int, timeout_s: float = TIMEOUT_S) -> socket.socket:
    """A connection to a server that may still be starting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((address, port), timeout=timeout_s)
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def echo(address: str, port: int, message: bytes) -> str:
    with connect(address, port) as conn:
        conn.sendall(message)
        return conn.recv(128).decode()


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def test_each_host_sees_only_its_own_interfaces(two: dict[str, Host]) -> None:
    for host in two.values():
        rows = [line.split() for line in host.run(["ip", "-o", "-4", "addr"]).stdout.splitlines()]
        assert {(row[1], row[3]) for row in rows} == {
            ("lo", "127.0.0.1/8"),
            ("eth0", f"{host.address}/24"),
        }
        # UCX lists interfaces in /sys: `ip netns exec` mounts the host's own there.
        assert host.run(["ls", "/sys/class/net"]).stdout.split() == ["eth0", "lo"]
    assert two["a"].address != two["b"].address


def test_hosts_reach_each_other_and_the_pytest_process_reaches_them(
    two: dict[str, Host],
) -> None:
    a, b = two["a"], two["b"]
    for host in (a, b):
        host.popen([sys.executable, "-c", ECHO, host.address, str(PORT)])
    client = a.run([sys.executable, "-c", CLIENT, b.address, str(PORT)])
    assert client.stdout.split() == [a.address, "ping"]  # b saw a's own address
    assert echo(a.address, PORT, b"hello").split() == [a.root_address, "hello"]
    assert echo(b.address, PORT, b"hello").split() == [b.root_address, "hello"]


def test_an_http_server_in_a_answers_the_pytest_process(
    two: dict[str, Host], tmp_path: Path
) -> None:
    a = two["a"]
    (tmp_path / "hello.txt").write_text("from host a")
    a.popen(
        [sys.executable, "-m", "http.server", "--bind", a.address, "-d", str(tmp_path), "8000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    connect(a.address, 8000).close()
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with no_proxy.open(f"http://{a.address}:8000/hello.txt", timeout=TIMEOUT_S) as response:
        assert response.read() == b"from host a"


@pytest.mark.parametrize("body_raises", [False, True], ids=["returns", "raises"])
def test_teardown_leaves_no_namespace_link_or_process(body_raises: bool) -> None:
    failing = pytest.raises(RuntimeError) if body_raises else contextlib.nullcontext()
    with failing, hosts("a", "b", "c", stop_timeout_s=0.2) as made:
        sleepers = [host.popen(["sleep", "600"]) for host in made.values()]
        # It ignores SIGTERM, and so does its child, which popen did not start.
        stubborn = made["c"].popen(["sh", "-c", "trap '' TERM; sleep 600 & wait"])
        prefix = made["a"].netns.removesuffix("-a")  # lmdt<pid>-<use>
        namespaces = set(ip("netns", "list").split())
        assert {f"{prefix}-{name}" for name in ("a", "b", "c", "sw")} <= namespaces
        root_link = _link_index(made["a"].root_address)  # never reused soon, unlike names
        assert root_link is not None
        pids = _pids_when(lambda found: len(found) == 5, made.values())  # sh forked its sleep
        if body_raises:
            raise RuntimeError("the test body failed")
    assert not [ns for ns in ip("netns", "list").split() if ns.startswith(f"{prefix}-")]
    assert f"{root_link}: " not in ip("-o", "link")
    assert [p.returncode for p in sleepers] == [-15, -15, -15]
    assert stubborn.returncode == -9
    assert not [pid for pid in pids if _running(pid)]


def test_two_uses_get_separate_networks() -> None:
    with hosts("a") as first, hosts("a") as second:
        assert first["a"].netns != second["a"].netns
        assert first["a"].address.rsplit(".", 1)[0] != second["a"].address.rsplit(".", 1)[0]


@pytest.mark.timeout(90)
def test_nixl_writes_4_mib_from_a_into_b_across_the_link(two: dict[str, Host]) -> None:
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("NIXL is not installed (pip install lmd[cluster])")
    a, b = two["a"], two["b"]
    received_before = _rx_bytes(b)
    # os._exit: torch's exit handlers cost a second or two, and there is nothing to save.
    call = "import os, sys; from tests.unit.test_netns import {0}; {0}({1!r}, {2}, {3}, 7); "
    call += "sys.stdout.flush(); os._exit(0)"
    receiver, sender = (
        host.popen(
            [sys.executable, "-c", call.format(role, b.address, PORT, NIXL_BYTES)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for host, role in ((b, "nixl_receive"), (a, "nixl_send"))
    )
    sent, _ = sender.communicate(timeout=60)
    received, _ = receiver.communicate(timeout=60)
    assert sender.returncode == 0, sent
    assert receiver.returncode == 0, received
    assert "4194304 bytes exact" in received
    # The bytes crossed b's link (UCX_TLS=tcp), not shared memory between namespaces.
    assert _rx_bytes(b) - received_before >= NIXL_BYTES


# ----------------------------------------------------- processes inside the fake hosts


def nixl_receive(address: str, port: int, nbytes: int, seed: int) -> None:
    """Register `nbytes`, hand the descriptor to the sender, check what it wrote."""
    from lmd.migration.nixl import NixlTransport

    expected = random.Random(seed).randbytes(nbytes)
    with NixlTransport() as transport, socket.create_server((address, port)) as server:
        region = transport.create_region(nbytes)
        server.settimeout(TIMEOUT_S)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(TIMEOUT_S)
            descriptor = region.descriptor()
            conn.sendall(len(descriptor).to_bytes(4, "little") + descriptor)
            assert conn.recv(4) == b"sent", "the sender's write did not finish"
            deadline = time.monotonic() + TIMEOUT_S
            while not (notes := transport.notifications()):
                assert time.monotonic() < deadline, "no notification from the sender"
                time.sleep(0.01)
            exact = bytes(region) == expected
            conn.sendall(b"ok" if exact else b"no")
        assert [note for _, note in notes] == [b"written"]
        assert exact, "the bytes written differ from the sender's"
        print(f"{nbytes} bytes exact")
        region.close()


def nixl_send(address: str, port: int, nbytes: int, seed: int) -> None:
    """Write `nbytes` from `seed` into the receiver's region in one WRITE."""
    from lmd.migration.nixl import NixlTransport

    with NixlTransport() as transport, connect(address, port) as conn:
        size = int.from_bytes(_recv_exactly(conn, 4), "little")
        peer = transport.open(_recv_exactly(conn, size))
        src = transport.create_region(nbytes)
        src[:] = random.Random(seed).randbytes(nbytes)
        ticket = transport.submit(src, peer, [(0, 0, nbytes)], notify=b"written")
        assert ticket.wait(TIMEOUT_S), "the write did not finish"
        conn.sendall(b"sent")
        assert conn.recv(2) == b"ok", "the receiver found other bytes"
        peer.close()
        src.close()


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        assert chunk, "the peer closed the connection"
        data += chunk
    return data


def _pids_when(done: Callable[[list[int]], bool], made: Iterable[Host]) -> list[int]:
    """The processes in the hosts once `done` says so; fails after TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        found = [int(pid) for host in made for pid in ip("netns", "pids", host.netns).split()]
        if done(found) or time.monotonic() >= deadline:
            assert done(found), f"processes in the hosts: {found}"
            return found
        time.sleep(0.01)


def _link_index(address: str) -> int | None:
    """The index of the root namespace's link holding `address`."""
    for line in ip("-o", "-4", "addr").splitlines():
        if f" {address}/" in line:
            return int(line.split(":", 1)[0])
    return None


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (its parent may not have reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _rx_bytes(host: Host) -> int:
    return int(host.run(["cat", "/sys/class/net/eth0/statistics/rx_bytes"]).stdout)
