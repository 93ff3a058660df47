"""supervisor/limits.py: lmdd raises its soft open-files limit to the hard one."""

from __future__ import annotations

import resource
import subprocess
import sys

RAISE = (
    "import resource; from lmd.supervisor.limits import raise_open_files_limit as r;"
    "print(r(), *resource.getrlimit(resource.RLIMIT_NOFILE))"
)


def run_with_limit(soft: int, hard: int) -> list[int]:
    """Call it in a child whose RLIMIT_NOFILE starts at (soft, hard); what it says."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    out = subprocess.run(
        [sys.executable, "-c", RAISE], preexec_fn=limit, capture_output=True, check=True
    )
    return [int(n) for n in out.stdout.split()]


def test_the_soft_limit_goes_up_to_the_hard_one() -> None:
    """systemd's default for a service is 1024 soft: the api could hold ~1,000 streams."""
    assert run_with_limit(1024, 4096) == [4096, 4096, 4096]


def test_a_limit_already_at_the_hard_one_stays() -> None:
    assert run_with_limit(512, 512) == [512, 512, 512]
