"""The accept loop of an HTTP server: a cap on open connections, and no harm done when
the process runs out of file descriptors.

uvicorn serves through `loop.create_server`, whose accept loop (libuv's, under uvloop)
meets EMFILE by resetting the waiting connections without a word, and stops listening for
good when its spare descriptor is gone too. A `Listener` instead:
  1. watches the listening socket and accepts up to ACCEPT_BATCH connections each time it
     is readable (so one busy socket cannot hold the event loop);
  2. hands a connection to the HTTP protocol while fewer than `max_connections` are open;
  3. answers one past the cap with `refusal` (a complete 503 response) and closes it;
  4. out of descriptors (EMFILE, ENFILE): closes a spare descriptor it keeps for this,
     accepts one waiting connection in its place, refuses it the same way and takes the
     spare back; when even that fails, it stops watching for a back-off (BACKOFF_S,
     doubling up to MAX_BACKOFF_S) while waiting clients stay in the listen backlog.
Each stretch of refusals is logged once when it starts and once QUIET_S after the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http
import logging
import os
import resource
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

ACCEPT_BATCH = 128
BACKOFF_S, MAX_BACKOFF_S = 0.05, 1.0
QUIET_S = 10.0  # without a refusal: the stretch of refusals is over (logged once)
# Descriptors kept free for the process's own use (log files, scrapes, reconnects).
HEADROOM = 64
_NO_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def default_max_connections() -> int:
    """The connections the open-files limit leaves room for: the soft RLIMIT_NOFILE less the
    descriptors open now and HEADROOM."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 0
    return max(soft - in_use - HEADROOM, 1)


def http_response(status: int, body: bytes, headers: Mapping[str, str]) -> bytes:
    """A whole HTTP/1.1 JSON response that closes its connection."""
    lines = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _open_spare() -> int | None:
    try:
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


class Listener:
    """Accepts connections on `sock` for `protocol_factory` (in the running loop).

    `num_open` counts the connections the protocols hold; those being handed over are
    added here. Stands in for the asyncio Server uvicorn keeps (close, wait_closed).
    """

    def __init__(
        self,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        *,
        max_connections: int,
        num_open: Callable[[], int],
        refusal: bytes,
    ) -> None:
        self.max_connections = max_connections
        self._sock = sock
        self._factory = protocol_factory
        self._num_open = num_open
        self._refusal = refusal
        self._loop = asyncio.get_running_loop()
        self._spare = _open_spare()
        self._handovers: set[asyncio.Task[object]] = set()
        self._backoff_s = BACKOFF_S
        self._paused: asyncio.TimerHandle | None = None
        self._refusing: str | None = None  # why new connections are refused now
        self._last_refusal = 0.0  # loop time
        self._quiet: asyncio.TimerHandle | None = None  # ends the stretch of refusals
        self._refused_before = 0  # num_refused when the refusals began
        self.num_refused = 0
        self._closed = False
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._accept_some)

    @property
    def num_open(self) -> int:
        return self._num_open() + len(self._handovers)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._quiet is not None:
            self._quiet.cancel()
        if self._paused is not None:
            self._paused.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None

    async def wait_closed(self) -> None:
        if self._handovers:
            await asyncio.wait(self._handovers)

    def _accept_some(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client left before we took it
            except OSError as exc:
                if exc.errno not in _NO_DESCRIPTORS:
                    log.warning("accepting a connection failed: %s", exc)
                    self._pause()
                    return
                self._refusing_since(f"out of file descriptors ({exc.strerror})")
                try:
                    self._refuse_with_spare()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    self._pause()
                    return
                continue
            if self.num_open >= self.max_connections:
                self._refusing_since(f"{self.max_connections} connections open (max_connections)")
                self._refuse(conn)
            else:
                self._backoff_s = BACKOFF_S
                self._hand_over(conn)

    def _hand_over(self, conn: socket.socket) -> None:
        task = self._loop.create_task(self._loop.connect_accepted_socket(self._factory, conn))
        self._handovers.add(task)
        task.add_done_callback(self._handed_over)

    def _handed_over(self, task: asyncio.Task[object]) -> None:
        self._handovers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a connection ended before it was served: %s", task.exception())

    def _refuse(self, conn: socket.socket) -> None:
        """Answer the 503 and close: the client reads it whatever it sent meanwhile."""
        self.num_refused += 1
        with contextlib.suppress(OSError):  # gone already: nobody to tell
            conn.send(self._refusal, socket.MSG_DONTWAIT)
        conn.close()

    def _refuse_with_spare(self) -> None:
        """Out of descriptors: free the spare to accept one waiting client and refuse it.
        Raises what accept raises (BlockingIOError: nobody waits)."""
        if self._spare is None:
            self._spare = _open_spare()  # some descriptor may have come back since
            raise OSError(errno.EMFILE, "no spare descriptor")
        os.close(self._spare)
        self._spare = None
        try:
            conn, _ = self._sock.accept()
            self._refuse(conn)
        finally:
            self._spare = _open_spare()

    def _pause(self) -> None:
        """Stop accepting for a while: waiting clients stay in the listen backlog."""
        self._loop.remove_reader(self._sock.fileno())
        self._paused = self._loop.call_later(self._backoff_s, self._resume)
        self._backoff_s = min(2 * self._backoff_s, MAX_BACKOFF_S)

    def _resume(self) -> None:
        self._paused = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._accept_some)

    def _refusing_since(self, reason: str) -> None:
        """Log the start of a stretch of refusals; its end once QUIET_S pass without one."""
        self._last_refusal = self._loop.time()
        if self._refusing is not None:
            return
        self._refusing, self._refused_before = reason, self.num_refused
        self._quiet = self._loop.call_later(QUIET_S, self._refusals_over)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.warning(
            "%s, open-files limit %d: answering new connections 503 until some close",
            reason,
            soft,
        )

    def _refusals_over(self) -> None:
        quiet_s = self._loop.time() - self._last_refusal
        if quiet_s < QUIET_S:
            self._quiet = self._loop.call_later(QUIET_S - quiet_s, self._refusals_over)
            return
        self._quiet = None
        refused = self.num_refused - self._refused_before
        log.info("accepting connections again; %d refused (%s)", refused, self._refusing)
        self._refusing = None
