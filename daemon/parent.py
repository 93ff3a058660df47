"""A child process that must not outlive its parent (workers under the supervisor, the
ranks of a tensor-parallel group under their engine worker)."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG; the parent must have
    started it from its main thread: the signal follows the thread that forked), and exit
    now if the parent is already gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
