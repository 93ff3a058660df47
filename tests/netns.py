"""Fake hosts for multi-host tests: Linux network namespaces joined by one bridge.

Layout of one `hosts("a", "b")` on the free private /24 N (10.231.X.0/24 unless the
machine routes it):

    pytest process (root namespace)  lmdnetX  N.1 ─┐
    host "a" (namespace <prefix>-a)  eth0     N.2 ─┼─ bridge br0 in namespace <prefix>-sw
    host "b" (namespace <prefix>-b)  eth0     N.3 ─┘

Every host reaches every other host and the pytest process, and the pytest process
reaches every host; nothing else is routed. A host's ports are its own: fixed port
numbers inside a host never collide with another run. Commands run in a host through
`ip netns exec`, which also mounts the host's own /sys: UCX lists network interfaces
there, and sees the host's lo and eth0 only.

UCX still sees every namespace of this machine as one node (same boot id, same IPC and
PID namespaces) and, left to choose, moves bytes between hosts through shared memory
(cma); so a host's processes get UCX_TLS=tcp (`Host.ucx_env`) and KV bytes cross eth0.

Life cycle of one `hosts(...)`:
  1. namespaces left by dead runs (named lmdt<pid>-..., pid gone) are deleted;
  2. the switch namespace and its bridge are made, then a /24 is claimed: creating the
     root-side veth lmdnet<X> is atomic, so two runs never take the same one;
  3. per host: a namespace, lo up, a veth `eth0` into the bridge with the host's address;
  4. the body runs; `Host.popen` processes are tracked;
  5. teardown, even when the body raised: SIGTERM to the processes popen started,
     SIGKILL to all left in the namespaces once those exited or after `stop_timeout_s`,
     then the root link and every namespace are deleted.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

HOST_NAME = re.compile(r"[a-z][a-z0-9]{0,9}")  # h-<name>, its bridge port: <= 15 bytes
STALE = re.compile(r"lmdt(\d+)-\d+-")  # namespaces of the run with that pid
INTERFACE = "eth0"  # every host's link
# Candidate /24s, in order: 10.231.0-255.0, then 172.31.0-255.0.
SUBNETS = [
    ipaddress.IPv4Network(f"{base}.{i}.0/24") for base in ("10.231", "172.31") for i in range(256)
]
_uses = itertools.count(1)  # this process's hosts() calls: part of every name it makes


class Host:
    """One fake machine: namespace `netns`, with lo and eth0 holding `address`."""

    def __init__(self, name: str, address: str, netns: str, root_address: str) -> None:
        self.name = name
        self.address = address
        self.netns = netns
        self.root_address = root_address  # the pytest process's address on this network
        self.processes: list[subprocess.Popen[Any]] = []  # from popen, stopped at teardown

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address!r}, netns={self.netns!r})"

    @property
    def ucx_env(self) -> dict[str, str]:
        """UCX over this host's link: TCP only (UCX would take shared memory between two
        namespaces of one machine), and cuda_copy on a GPU machine, where NIXL refuses
        host memory without it."""
        gpu = Path("/dev/nvidiactl").exists()
        return {"UCX_TLS": "tcp,cuda_copy" if gpu else "tcp"}

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host (`ip netns exec` execs it: same pid)."""
        return [_ip(), "netns", "exec", self.netns, *argv]

    def env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """A host process's environment: os.environ, then `ucx_env`, then `env`."""
        return {**os.environ, **self.ucx_env, **(env or {})}

    def popen(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[Any]:
        """Start `argv` in this host (environment: `env()`); stopped at teardown."""
        process = subprocess.Popen(self.argv(argv), env=self.env(env), **kw)
        self.processes.append(process)
        return process

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in this host to its end; its output as text."""
        return subprocess.run(
            self.argv(argv),
            env=self.env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )


@functools.cache
def skip_reason() -> str | None:
    """Why `hosts()` cannot run here (for pytest.skip), or None if it can."""
    if not sys.platform.startswith("linux"):
        return "fake hosts need Linux network namespaces"
    if shutil.which("ip") is None and not Path("/usr/sbin/ip").exists():
        return "fake hosts need iproute2's `ip` (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "fake hosts need root (`ip netns add`); run the tests as root"
    probe = f"lmdt{os.getpid()}-0-probe"
    try:
        _ip_run("netns", "add", probe)
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _ip_run("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip_run("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except RuntimeError as exc:
        return f"cannot create a bridge or veth pair: {exc}"
    finally:
        _delete_netns(probe)
    return None


@contextlib.contextmanager
def hosts(*names: str, stop_timeout_s: float = 5.0) -> Iterator[dict[str, Host]]:
    """Fake hosts named `names` (addresses .2, .3, ... in that order), by name; all torn
    down on exit. RuntimeError saying which `ip` command failed if one cannot be made."""
    if not names or len(set(names)) != len(names):
        raise ValueError(f"host names must be given once each, got {names}")
    for name in names:
        if not HOST_NAME.fullmatch(name):
            raise ValueError(f"host name {name!r}: 1-10 of a-z and 0-9, a letter first")
    _reap_stale()
    prefix = f"lmdt{os.getpid()}-{next(_uses)}"
    switch = f"{prefix}-sw"
    made: list[Host] = []
    with contextlib.ExitStack() as stack:
        _ip_run("netns", "add", switch)
        stack.callback(_delete_netns, switch)
        _ip_run("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip_run("-n", switch, "link", "set", "dev", "br0", "up")
        subnet, root_link = _claim_subnet(switch)
        stack.callback(_delete_link, root_link)
        addresses = list(subnet.hosts())  # .1 the pytest process, then the hosts
        _ip_run("addr", "add", f"{addresses[0]}/24", "dev", root_link)
        _ip_run("link", "set", "dev", root_link, "up")
        _ip_run("-n", switch, "link", "set", "dev", "root", "master", "br0", "up")
        for name, address in zip(names, addresses[1:], strict=False):
            host = Host(name, str(address), f"{prefix}-{name}", str(addresses[0]))
            _ip_run("netns", "add", host.netns)
            stack.callback(_delete_netns, host.netns)
            _ip_run("-n", host.netns, "link", "set", "dev", "lo", "up")
            _ip_run(
                "link", "add", INTERFACE, "netns", host.netns, "type", "veth",
                "peer", "name", f"h-{name}", "netns", switch,
            )  # fmt: skip
            _ip_run("-n", host.netns, "link", "set", "dev", INTERFACE, "addrgenmode", "none")
            _ip_run("-n", host.netns, "addr", "add", f"{address}/24", "dev", INTERFACE)
            _ip_run("-n", host.netns, "link", "set", "dev", INTERFACE, "up")
            _ip_run("-n", switch, "link", "set", "dev", f"h-{name}", "master", "br0", "up")
            made.append(host)
        # Registered last, run first: nothing may keep a namespace alive.
        stack.callback(_stop, made, [switch], stop_timeout_s)
        yield {host.name: host for host in made}


# ----------------------------------------------------------------------------- helpers


@functools.cache
def _ip() -> str:
    return shutil.which("ip") or "/usr/sbin/ip"


def _ip_call(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_ip(), *args], capture_output=True, text=True, timeout=30, check=False)


def _ip_run(*args: str) -> str:
    """Run `ip args`; its stdout, or RuntimeError with the command and its error."""
    done = _ip_call(*args)
    if done.returncode != 0:
        error = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {error[0]}")
    return done.stdout


def _claim_subnet(switch: str) -> tuple[ipaddress.IPv4Network, str]:
    """The first candidate /24 nothing routes whose root link this call could create
    (the link's name holds the /24's index: a taken one exists already)."""
    routes = json.loads(_ip_run("-j", "-4", "route", "show", "table", "all") or "[]")
    used = [ipaddress.ip_network(r["dst"], strict=False) for r in routes if r["dst"] != "default"]
    for index, subnet in enumerate(SUBNETS):
        if any(subnet.overlaps(net) for net in used):
            continue
        link = f"lmdnet{index}"
        args = ["link", "add", link, "type", "veth", "peer", "name", "root", "netns", switch]
        done = _ip_call(*args)
        if done.returncode == 0:
            return subnet, link
        if "exists" not in done.stderr:
            raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    raise RuntimeError(f"no free /24 among {SUBNETS[0]} .. {SUBNETS[-1]}: all routed or taken")


def _pids(netns: str) -> list[int]:
    """Processes whose network namespace is `netns` (none once it is gone)."""
    done = _ip_call("netns", "pids", netns)
    return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []


def _signal(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _stop(made: Sequence[Host], others: Sequence[str], timeout_s: float) -> None:
    """SIGTERM what popen started (a launcher stops its own children, as on a real
    host); after `timeout_s`, or once those exited, SIGKILL whatever is left in the
    namespaces."""
    started = [p for host in made for p in host.processes]
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in started) and time.monotonic() < deadline:
        time.sleep(0.02)
    namespaces = [host.netns for host in made] + list(others)
    deadline = time.monotonic() + 10.0
    while (pids := [pid for ns in namespaces for pid in _pids(ns)]) and (
        time.monotonic() < deadline
    ):
        _signal(pids, signal.SIGKILL)
        time.sleep(0.02)
    for process in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=1.0)  # a zombie has left its namespace: reap it
    if pids:
        raise RuntimeError(f"processes {pids} outlived SIGKILL in namespaces {namespaces}")


def _delete_link(link: str) -> None:
    with contextlib.suppress(RuntimeError):  # gone already with its namespace
        _ip_run("link", "del", "dev", link)


def _delete_netns(netns: str) -> None:
    _ip_run("netns", "del", netns)


def _reap_stale() -> None:
    """Delete namespaces a dead run left (killed before its teardown), and stop what
    still runs in them."""
    names = [line.split()[0] for line in _ip_run("netns", "list").splitlines() if line]
    for name in names:
        match = STALE.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        _signal(_pids(name), signal.SIGKILL)
        with contextlib.suppress(RuntimeError):  # another run reaped it meanwhile
            _delete_netns(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
