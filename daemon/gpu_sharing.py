"""How the prefill and decode processes of one GPU share it: time-sliced (the driver's
default) or through NVIDIA's Multi-Process Service (`--gpu-sharing mps`).

Time-sliced, two CUDA processes never run kernels at the same moment: a prefill step's
compute-bound GEMMs cannot fill the multiprocessors that a decode step, bound by its
weight reads, leaves idle. Under MPS they run side by side (on an H200, Llama-3-8B shape,
c=256: +3-6% output tokens/s with prefill held to 70% of the multiprocessors, +12%
unheld, where decode steps then wait on prefill's; docs/benchmarks.md, "Prefill and
decode on one GPU through MPS").

The trade, and why it is not the default: MPS reports a fatal GPU fault of one client to
every client of that GPU, and takes no new client until all of them have exited. A
prefill process that faults takes decode (and its running requests) with it; the
supervisor restarts both.

Life cycle (`--gpu-sharing mps`):
1. Before the workers spawn, `control_daemon` runs `nvidia-cuda-mps-control -d` with
   its pipe and log directories under the runtime directory (a control daemon left
   there by a daemon that died is told to quit first) and puts them in the supervisor's
   environment: every worker inherits it, and its first CUDA call connects to MPS.
2. A prefill worker sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (`--mps-prefill-percent`)
   before it touches CUDA (`worker_share`; its tensor-parallel ranks inherit it).
3. When the workers have stopped, `quit` goes to the control daemon.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lmd.config import ConfigError, ServeConfig
from lmd.protocol.roles import Role

log = logging.getLogger("lmd.gpu_sharing")

CONTROL = "nvidia-cuda-mps-control"  # comes with the NVIDIA driver
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
CONTROL_TIMEOUT_S = 30.0


class GpuSharingError(Exception):
    """The MPS control daemon could not be started (or its program did not answer)."""


def check_gpu_sharing(config: ServeConfig, device: str) -> None:
    """ConfigError (one line) for `--gpu-sharing mps` where it cannot work: engines not
    on CUDA, or no control program. `device` is the daemon's, auto resolved."""
    if config.gpu_sharing != "mps":
        return
    devices = {config.role_device(r, device) for r in (Role.PREFILL, Role.DECODE)}
    if not all(d.startswith("cuda") for d in devices):
        raise ConfigError(
            f"gpu_sharing: mps shares a GPU between CUDA processes; the engines run on "
            f"{', '.join(sorted(devices))}"
        )
    if shutil.which(CONTROL) is None:
        raise ConfigError(
            f"gpu_sharing: mps needs {CONTROL} on PATH (it comes with the NVIDIA driver)"
        )


def worker_share(config: ServeConfig, role: Role) -> None:
    """In a worker before CUDA starts: a prefill process under MPS gets its share of
    the multiprocessors (decode may use all of them)."""
    if config.gpu_sharing == "mps" and role == Role.PREFILL:
        os.environ[SHARE_ENV] = str(config.mps_prefill_percent)


@contextmanager
def control_daemon(config: ServeConfig) -> Iterator[None]:
    """The MPS control daemon for the time the workers run (nothing unless `--gpu-sharing
    mps`). Raises GpuSharingError when it does not start."""
    control = shutil.which(CONTROL) if config.gpu_sharing == "mps" else None
    if control is None:  # check_gpu_sharing refused mps without it
        yield
        return
    env = {PIPE_ENV: str(config.runtime_dir / "mps"), LOG_ENV: str(config.runtime_dir / "mps-log")}
    for path in env.values():
        Path(path).mkdir(mode=0o700, exist_ok=True)
    _run(control, env, [], "quit\n")  # one a dead daemon left behind (none: it cannot connect)
    code, said = _run(control, env, ["-d"], "")
    if code != 0:
        raise GpuSharingError(f"{CONTROL} -d failed: {said or f'exit code {code}'}")
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    log.info("MPS control daemon started (pipes in %s)", env[PIPE_ENV])
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        try:
            _run(control, env, [], "quit\n")
            log.info("MPS control daemon stopped")
        except GpuSharingError as exc:  # the workers are gone: say so, stop anyway
            log.warning("MPS control daemon not stopped: %s", exc)


def _run(control: str, env: dict[str, str], args: list[str], stdin: str) -> tuple[int, str]:
    """Run the control program with these pipes: its exit code and what it said. Its
    output goes to a file, not a pipe: with -d it forks the daemon, which would hold a
    pipe open after the program itself has exited."""
    with open(Path(env[LOG_ENV]) / "control-program.txt", "w+") as out:
        try:
            done = subprocess.run(  # the driver's program, found on PATH
                [control, *args],
                input=stdin,
                env=os.environ | env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=CONTROL_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise GpuSharingError(f"{CONTROL} {' '.join(args)}: {exc}") from None
        out.seek(0)
        return done.returncode, out.read().strip()
