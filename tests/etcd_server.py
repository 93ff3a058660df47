"""A real single-member etcd for tests: free ports, a throwaway data dir, start/stop/restart.

Lifecycle: `EtcdServer(tmp_path)` picks two free ports (client, peer) once, so that a
restart comes back at the same address; `start()` runs `etcd` and waits until it answers
/health; `stop()` ends it (SIGTERM, or SIGKILL with kill=True) and keeps the data dir;
`restart(wipe=True)` starts it again empty, as if the etcd cluster had been rebuilt.
Also a context manager (`with EtcdServer(tmp) as etcd:`), which stops it at the end.

The heartbeat and election timeout are shorter than etcd's defaults so that its minimum
lease TTL is 1 s (etcd rounds a shorter TTL up to ceil(1.5 * election timeout)).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.netns import Host


def etcd_binary() -> str | None:
    """The `etcd` program on PATH (or Debian's /usr/bin/etcd), None if there is none."""
    found = shutil.which("etcd")
    if found is None and Path("/usr/bin/etcd").is_file():
        found = "/usr/bin/etcd"
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EtcdServer:
    """One etcd member on 127.0.0.1; `url` is what `lmdd serve --cluster` takes."""

    def __init__(
        self, tmp_dir: Path, start_timeout_s: float = 20.0, host: Host | None = None
    ) -> None:
        """`host`: run in that network namespace (tests/netns.py), on its address."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.binary = binary
        self.netns_host = host
        self.host = host.address if host else "127.0.0.1"
        # A namespace has its own ports: etcd's usual ones are free there.
        self.port = 2379 if host else free_port()
        self.peer_port = 2380 if host else free_port()
        self.data_dir = tmp_dir / "etcd-data"
        self.log_path = tmp_dir / "etcd.log"
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Run etcd and wait until it answers /health; raise with its log if it does not."""
        if self.running:
            return
        client = f"http://{self.host}:{self.port}"
        peer = f"http://{self.host}:{self.peer_port}"
        argv = [
            self.binary,
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--initial-cluster-state=new",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=warn",
        ]
        with self.log_path.open("ab") as log:
            if self.netns_host is not None:
                self._proc = self.netns_host.popen(argv, stdout=log, stderr=subprocess.STDOUT)
            else:
                self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if self._healthy():
                return
            time.sleep(0.1)
        self.stop(kill=True)
        log_tail = self.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"etcd did not become healthy on {client}; its log:\n{log_tail}")

    def stop(self, kill: bool = False) -> None:
        """End etcd (SIGTERM, or SIGKILL with kill=True) and wait for it; keeps the data dir."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def restart(self, wipe: bool = False) -> None:
        """Stop and start again at the same address; wipe=True starts with no data."""
        self.stop()
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start()

    def _healthy(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy
        try:
            with opener.open(f"http://{self.host}:{self.port}/health", timeout=1) as reply:
                return b'"true"' in reply.read()
        except (OSError, ValueError):
            return False

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
