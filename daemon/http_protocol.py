"""One HTTP/1.1 connection of the api or the control socket: uvicorn's h11 protocol, with
four rules uvicorn lacks.

- Header timeout: a connection whose request line and headers are not complete within
  `header_timeout_s` (of its opening, or of the first byte of a later request on it) is
  closed. Without it a client that sends half a request holds its descriptor for good.
- No close over a request that has come: uvloop runs the timers that came due while its
  callbacks ran before it polls the sockets again, so on a busy api the keep-alive (or
  header) timer fired after the client's next request had arrived but before it was
  read, and closing a socket with unread bytes sends a reset (TcpExtTCPAbortOnData): the
  client, which had sent its request on a connection it was entitled to reuse, got a
  connection reset (httpx ReadError). A timer that finds bytes waiting (FIONREAD) gives
  the loop READ_GRACE_S to read them; the request, once read, stops the keep-alive timer
  and gets the header timeout like any other.
- Half-close: a client that sends its request and then shuts down its write side
  (`nc -N`, some proxies) still gets the answer; uvicorn took the end of its input for a
  disconnect and dropped the request. The end of input with a request pending closes the
  connection only once the answer is sent. A client gone for good shows as a failed
  write: until the answer starts, an interim `100 Continue` goes out at once and then at
  growing intervals (RFC 9110 15.2: every HTTP/1.1 client takes unasked 1xx answers), and
  the reset a closed client's host answers it with aborts the request as before.
- On a Unix socket (the control API) each connection's peer, as the kernel saw it connect
  (SO_PEERCRED: pid, uid, gid), is logged at debug level and handed to the app in every
  request's `scope["state"]["peer"]`; bytes that are not HTTP at all are answered with the
  control API's structured error, not uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios
from dataclasses import astuple, dataclass
from typing import Any

import h11
import orjson
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

log = logging.getLogger(__name__)

# Seconds between interim answers to a half-closed client: the first one at once, the
# second soon (its reset comes back within a round trip), then doubling up to the last.
PROBE_INTERVALS_S = (0.05, 5.0)
# What a timer that finds bytes waiting gives the loop to read them: one turn is enough, so
# a client that trickles its headers gains at most this once per request.
READ_GRACE_S = 0.1
_CONTINUE = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
_INT = struct.Struct("i")


def bytes_waiting(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for this connection that the event loop has not read yet."""
    sock = transport.get_extra_info("socket")
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(_INT.size))
    except (AttributeError, OSError, ValueError):  # no socket, closed (fileno -1), or not
        return 0  # one FIONREAD knows
    return int(_INT.unpack(raw)[0])


class Connection(H11Protocol):
    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        header_timeout_s: float,
        keep_alive_s: float,
    ) -> None:
        super().__init__(config, server_state, app_state)
        self.header_timeout_s = header_timeout_s
        # uvicorn's idle time, else read from its config; typed int there, but it only
        # goes to call_later, and tests need less than a second.
        self.timeout_keep_alive = keep_alive_s  # type: ignore[assignment]
        self._header_timer: asyncio.TimerHandle | None = None
        self._probe_timer: asyncio.TimerHandle | None = None
        self._probe_interval_s = 0.0
        self._half_closed = False
        self._header_grace_used = False  # READ_GRACE_S given to this request's headers

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._probe_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._probe_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio.Protocol's
        """The client sends nothing more. True keeps the connection open for the answer."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or cycle.more_body:
            return None  # nothing to answer, or a body that can never complete: close
        cycle.keep_alive = False  # nothing more can come: close once answered
        if not self._half_closed:
            self._half_closed = True
            if self.scope["http_version"] == "1.1":  # no 1xx to HTTP/1.0 (RFC 9110 15.2)
                self._probe()
        return True

    def _watch_headers(self) -> None:
        """Arm the header timer while a request's headers are incomplete, else disarm it."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)
        elif not waiting and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
            self._header_grace_used = False

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if not self._header_grace_used and bytes_waiting(self.transport):
            self._header_grace_used = True  # the headers may be complete once read
            self._header_timer = self.loop.call_later(READ_GRACE_S, self._too_slow)
            return
        log.debug(
            "closing a connection from %s: no complete request headers within %g s",
            self.client,
            self.header_timeout_s,
        )
        if self.conn.our_state is h11.IDLE:
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's close of an idle kept-alive connection, unless the next request has
        come and waits to be read (data_received then stops this timer)."""
        if bytes_waiting(self.transport) and not self.transport.is_closing():
            handler = self.timeout_keep_alive_handler
            self.timeout_keep_alive_task = self.loop.call_later(READ_GRACE_S, handler)
            return
        super().timeout_keep_alive_handler()

    def _probe(self) -> None:
        """An interim answer while a half-closed client waits: a gone one resets it."""
        self._probe_timer = None
        if self.transport.is_closing() or self.cycle.response_started:
            return
        try:
            self.transport.write(self.conn.send(_CONTINUE))
        except h11.LocalProtocolError:
            return  # h11 is past the point of interim answers: the final one is coming
        first, last = PROBE_INTERVALS_S
        self._probe_interval_s = min(max(2 * self._probe_interval_s, first), last)
        self._probe_timer = self.loop.call_later(self._probe_interval_s, self._probe)


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end of a Unix socket connection, when it connected."""

    pid: int
    uid: int
    gid: int


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_of(sock: Any) -> Peer | None:
    """SO_PEERCRED of a connected Unix socket; None where there is none (not Linux, no peer)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (AttributeError, OSError):
        return None
    peer = Peer(*_UCRED.unpack(raw))
    return None if peer.uid == -1 else peer  # the kernel's "nobody there": (0, -1, -1)


class UnixConnection(Connection):
    """A control socket connection: knows its peer, answers junk in JSON."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = peer_of(transport.get_extra_info("socket"))
        if peer is not None:
            where = transport.get_extra_info("sockname")
            log.debug("%s: connection from pid %d uid %d gid %d", where, *astuple(peer))
        # uvicorn copies app_state into each request's scope["state"]: one per connection
        self.app_state = {**self.app_state, "peer": peer}
        super().connection_made(transport)

    def send_400_response(self, msg: str) -> None:
        body = orjson.dumps({"error": {"code": "bad_request", "message": msg}})
        head = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
        head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        self.transport.write(head + body)
        self.transport.close()
