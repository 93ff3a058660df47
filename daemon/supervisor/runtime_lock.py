"""One daemon per runtime directory: an flock on `lmdd.lock`, held for life.

The kernel drops the lock when the holder dies, however it dies, so a crashed daemon
never blocks the next start; the next holder then removes the sockets and the api's
metrics files it left behind (a new daemon's counters start from zero).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

from lmd.paths import control_socket_path, lock_path, metrics_dir


class AlreadyRunning(RuntimeError):
    """Another daemon holds the runtime directory."""


class RuntimeLock:
    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        self._fd: int | None = None

    def acquire(self) -> None:
        path = lock_path(self.runtime_dir)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise AlreadyRunning(
                f"another lmdd (pid {holder}) is running on runtime dir {self.runtime_dir}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def remove_leftovers(self) -> list[Path]:
        """Delete the socket files and the metrics directory (a dead daemon's, or ours at
        exit); hold the lock. Returns the sockets removed."""
        shutil.rmtree(metrics_dir(self.runtime_dir), ignore_errors=True)
        stale = [*self.runtime_dir.glob("*.ipc"), control_socket_path(self.runtime_dir)]
        removed = []
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        return removed

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                lock_path(self.runtime_dir).unlink()
            os.close(self._fd)
            self._fd = None
