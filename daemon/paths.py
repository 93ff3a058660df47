"""Where a daemon keeps its sockets: the runtime directory and the names inside it.

Stdlib only, so that `lmdctl` can find the control socket without importing the engine.
Every socket path is derived here from the runtime directory, so two daemons with
different runtime directories never collide.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

CONTROL_SOCKET = "control.sock"
LOCK_FILE = "lmdd.lock"
METRICS_DIR = "metrics"
# sun_path holds 108 bytes; keep room for the longest name we put in the directory.
MAX_SOCKET_PATH = 107
LONGEST_NAME = "tokenizer-000.ipc"


class RuntimeDirError(RuntimeError):
    """The runtime directory cannot be used (unsafe owner, bad mode, path too long)."""


def resolve_runtime_dir(
    explicit: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """Pick the runtime directory: explicit > $RUNTIME_DIRECTORY > $XDG_RUNTIME_DIR/lmd > temp.

    $RUNTIME_DIRECTORY is what systemd's RuntimeDirectory= sets; the last fallback is a
    per-user directory under the temp dir (`lmd-<uid>`).
    """
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit).expanduser().absolute()
    if env.get("RUNTIME_DIRECTORY"):
        # systemd may list several directories separated by ':'; ours is the first.
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]).absolute()
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "lmd"
    return Path(tempfile.gettempdir()) / f"lmd-{os.getuid()}"


def control_socket_path(runtime_dir: Path) -> Path:
    return runtime_dir / CONTROL_SOCKET


def metrics_dir(runtime_dir: Path) -> Path:
    """Where the api processes keep their Prometheus series (api/metrics.py)."""
    return runtime_dir / METRICS_DIR


def lock_path(runtime_dir: Path) -> Path:
    return runtime_dir / LOCK_FILE


def prepare_runtime_dir(runtime_dir: Path) -> None:
    """Create the directory (mode 0750) or check that an existing one is safe to use.

    A directory in a shared place (the temp dir) could have been made by someone else to
    intercept our sockets: it must be ours, a real directory, and not writable by others.
    """
    longest = len(str(runtime_dir / LONGEST_NAME))
    if longest > MAX_SOCKET_PATH:
        raise RuntimeDirError(
            f"runtime dir {runtime_dir} is too long for unix sockets "
            f"({longest} > {MAX_SOCKET_PATH} bytes); pass a shorter --runtime-dir"
        )
    try:
        runtime_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeDirError(f"cannot create runtime dir {runtime_dir}: {exc.strerror}") from exc
    st = runtime_dir.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime dir {runtime_dir} is not a directory")
    if st.st_uid != os.getuid():
        raise RuntimeDirError(
            f"runtime dir {runtime_dir} belongs to uid {st.st_uid}, not to us ({os.getuid()})"
        )
    if st.st_mode & stat.S_IWOTH:
        raise RuntimeDirError(f"runtime dir {runtime_dir} is writable by everyone; chmod o-w it")
