"""One NIXL agent with the UCX backend, built on NIXL's bindings (nixl._bindings).

Why not the nixl_agent class over them: it starts UCX's progress thread with a poll()
timeout of 0, which spins a whole core per process even when idle. The progress thread
is needed (the target of a TCP write only receives, and notifications only arrive, while
its UCX worker progresses), so the agent is built here with a 1 ms timeout: it wakes on
UCX events and costs next to nothing idle (docs/benchmarks.md, "Figures that code
comments used to quote").

Every call holds one lock (ticket waits run in threads beside the event loop) and every
NIXL error comes out as RuntimeError saying what failed. NIXL releases the GIL inside
its calls: a shared-memory write, which UCX runs inside the post itself, stalls no other
thread.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import threading
from collections.abc import Sequence
from typing import Any

from lmd.migration.base import Copy
from lmd.migration.nixl.descriptor import Span

INSTALL_HINT = "the nixl transport needs `pip install lmd[cluster]`"
PROGRESS_POLL_US = 1000  # the progress thread's poll() timeout


def bindings() -> Any:
    """NIXL's Python bindings; RuntimeError saying what to install when they are missing."""
    try:
        return importlib.import_module("nixl._bindings")
    except ImportError as exc:
        raise RuntimeError(f"{INSTALL_HINT} ({exc})") from None


class Agent:
    """A NIXL agent named `name`: registrations, loaded peers, posted writes."""

    def __init__(self, name: str) -> None:
        b = bindings()
        self._b = b
        self.errors: tuple[type[BaseException], ...] = tuple(
            getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error")
        )
        self.name = name
        config = b.nixlAgentConfig(True)  # with the progress thread
        config.pthrDelay = PROGRESS_POLL_US
        config.syncMode = b.NIXL_THREAD_SYNC_STRICT
        try:
            self._agent: Any = b.nixlAgent(name, config)
            self._backend = self._agent.createBackend("UCX", {})
        except self.errors as exc:
            raise RuntimeError(
                f"NIXL's UCX backend did not start ({what(exc)}); NIXL's log on stderr says "
                "why (often UCX_TLS: shm needs tcp beside it, GPU hosts need cuda_copy)"
            ) from None
        self._lock = threading.Lock()
        self._mems = {"DRAM": b.DRAM_SEG, "VRAM": b.VRAM_SEG}
        self._registrations: dict[int, Any] = {}  # key -> nixlRegDList
        self._keys = itertools.count()
        self._loaded: set[str] = set()  # peer agents whose metadata is loaded
        # Writes in flight: a handle is a pointer into NIXL, used only while listed here.
        self._handles: set[int] = set()
        self.closed = False

    def register(self, span: Span) -> int:
        """Register memory with UCX; the key to deregister it."""
        descs = self._b.nixlRegDList(
            self._mems[span.mem], [(span.addr, span.size, span.device, "")]
        )
        self._call(
            f"registering {span.size} bytes", self._agent.registerMem, descs, [self._backend]
        )
        key = next(self._keys)
        self._registrations[key] = descs
        return key

    def deregister(self, key: int) -> None:
        with self._lock:
            descs = self._registrations.pop(key, None)
            if descs is not None and not self.closed:
                self._quietly(self._agent.deregisterMem, descs, [self._backend])

    def metadata(self) -> bytes:
        """What a peer loads to write into this agent's registered memory."""
        return bytes(self._call("exporting metadata", self._agent.getLocalMD))

    def load(self, metadata: bytes) -> str:
        """Load (or load again) a peer's metadata; the peer agent's name."""
        name = self._call("loading a peer's metadata", self._agent.loadRemoteMD, metadata)
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        self._loaded.add(name)
        return name

    def forget(self, peer: str) -> None:
        """Drop a peer's metadata and disconnect from it."""
        with self._lock:
            if peer in self._loaded and not self.closed:
                self._loaded.discard(peer)
                self._quietly(self._agent.invalidateRemoteMD, peer)

    def post_write(
        self, local: Span, remote: Span, peer: str, copies: Sequence[Copy], notify: bytes
    ) -> int | None:
        """Post one WRITE of `copies` from `local` into `peer`'s `remote`: the handle to
        poll, or None when it completed inside the post. RuntimeError if refused."""
        b = self._b
        src = b.nixlXferDList(self._mems[local.mem], _rows(local, copies, 0))
        dst = b.nixlXferDList(self._mems[remote.mem], _rows(remote, copies, 1))
        with self._lock:
            if self.closed:
                raise RuntimeError("the nixl agent is closed")
            try:
                handle = self._agent.createXferReq(
                    b.NIXL_WRITE, src, dst, peer, notify, [self._backend]
                )
            except self.errors as exc:
                raise RuntimeError(f"nixl write to {peer} refused: {what(exc)}") from None
            try:
                status = self._agent.postXferReq(handle, notify)
            except self.errors as exc:
                status = exc
            if status == b.NIXL_IN_PROG:
                self._handles.add(int(handle))
                return int(handle)
            self._quietly(self._agent.releaseXferReq, handle)
        if status != b.NIXL_SUCCESS:
            failure = what(status) if isinstance(status, BaseException) else str(status)
            raise RuntimeError(f"nixl write to {peer} failed: {failure}")
        return None

    def finished(self, handle: int) -> bool:
        """True once the write is complete; RuntimeError if it failed."""
        b = self._b
        with self._lock:
            if handle not in self._handles:
                raise RuntimeError("nixl write abandoned: its transport was closed")
            try:
                status = self._agent.getXferStatus(handle)
            except self.errors as exc:
                raise RuntimeError(f"nixl write failed: {what(exc)}") from None
        if status == b.NIXL_IN_PROG:
            return False
        if status != b.NIXL_SUCCESS:
            raise RuntimeError(f"nixl write failed: {status}")
        return True

    def release(self, handle: int) -> None:
        """Free a write's handle (NIXL cancels it if it is still in flight)."""
        with self._lock:
            if handle in self._handles:
                self._handles.discard(handle)
                self._quietly(self._agent.releaseXferReq, handle)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call: (sending agent, message)."""
        received = self._call("reading notifications", self._agent.getNotifs, {})
        return [(str(peer), bytes(m)) for peer, msgs in received.items() for m in msgs]

    def close(self) -> None:
        """Deregister everything, forget every peer, stop the progress thread and UCX."""
        with self._lock:
            if self.closed:
                return
            for handle in self._handles:
                self._quietly(self._agent.releaseXferReq, handle)
            for descs in self._registrations.values():
                self._quietly(self._agent.deregisterMem, descs, [self._backend])
            for peer in self._loaded:
                self._quietly(self._agent.invalidateRemoteMD, peer)
            self._handles.clear()
            self._registrations.clear()
            self._loaded.clear()
            self.closed = True
            self._agent = None  # its destructor joins the progress thread

    def _call(self, doing: str, fn: Any, *args: Any) -> Any:
        with self._lock:
            if self.closed:
                raise RuntimeError("the nixl agent is closed")
            try:
                return fn(*args)
            except self.errors as exc:
                raise RuntimeError(f"nixl: {doing} failed: {what(exc)}") from None

    def _quietly(self, fn: Any, *args: Any) -> None:
        """A clean-up call (lock held): what it would clean is already gone."""
        with contextlib.suppress(*self.errors):
            fn(*args)


def what(exc: BaseException) -> str:
    """A NIXL error in words: nixlRemoteDisconnectError('NIXL_ERR_REMOTE_DISCONNECT') ->
    'RemoteDisconnect (NIXL_ERR_REMOTE_DISCONNECT)'."""
    kind = type(exc).__name__.removeprefix("nixl").removesuffix("Error")
    return f"{kind} ({exc})"


def _rows(span: Span, copies: Sequence[Copy], side: int) -> Any:
    """NIXL's descriptor rows for one side of the copies (0: source, 1: destination):
    [N, 3] uint64 (address, length, device)."""
    import numpy as np  # NIXL depends on it

    table = np.asarray(copies, dtype=np.uint64)  # [N, 3]: src_offset, dst_offset, nbytes
    rows = np.empty_like(table)
    rows[:, 0] = table[:, side] + np.uint64(span.addr)
    rows[:, 1] = table[:, 2]
    rows[:, 2] = span.device
    return rows
