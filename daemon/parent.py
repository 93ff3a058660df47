"""A child process that must not outlive its parent (workers under the supervisor, the
ranks of a tensor-parallel group under their engine worker), and how such a process
exits."""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG; the parent must have
    started it from a thread that lives as long as it, its main thread or one of its own:
    the signal follows the thread that forked), and exit now if the parent is already
    gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def exit_without_teardown(code: int, *, run_atexit: bool = False) -> NoReturn:
    """Exit, logs flushed, without the interpreter's teardown of its modules.
    `run_atexit`: the atexit functions first (multiprocessing's finalizers, which unlink
    the process's semaphores): how a worker exits, whose teardown would only have
    Triton's bindings (nanobind) print a report of some 600 objects "leaked" into the
    daemon's log at every stop. A process of a tensor-parallel group skips them too:
    NCCL's teardown (destroy_process_group, the process group's destructor) waits on ranks
    that are gone or stopping too (on two H200s: a clean stop ran into the supervisor's
    SIGKILL, a failed start took minutes or ended in SIGABRT). The OS frees the rest:
    pools are memfds, GPU budget ledger entries name a pid."""
    if run_atexit:
        atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
