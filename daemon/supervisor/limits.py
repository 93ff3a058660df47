"""Process limits lmdd raises at start, before it spawns a worker (workers inherit them).

Every HTTP connection the api holds is a file descriptor. The usual soft RLIMIT_NOFILE
(1024) is far below what a busy api needs, while the hard limit (systemd's default
524288, or the unit's LimitNOFILE) is what the administrator allows: the soft limit goes
up to the hard one. The api's default `max_connections` follows from what it gets.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

_NR_OPEN = "/proc/sys/fs/nr_open"  # the kernel's ceiling when the hard limit is unlimited


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _kernel_ceiling()
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
        return soft
    log.debug("open-files limit raised from %d to %d", soft, target)
    return target


def _kernel_ceiling() -> int:
    try:
        with open(_NR_OPEN) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20  # the kernel's default nr_open
