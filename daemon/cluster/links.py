"""Worker inboxes that other hosts reach: ZeroMQ over TCP, authenticated with CURVE.

In cluster mode a worker's inbox (one PULL socket) listens twice: on its ipc:// file for
peers on the same host (plain, as ipc.py: the runtime directory guards it) and on
tcp://HOST:PORT for other hosts, as a CURVE server that lets in only clients holding the
cluster key pair (keys.py). Other hosts send to it through `connect_push`.

How a TCP peer without the key is refused; each refusal is counted in
`Inbox.num_refused` and logged at WARNING (rate-limited, as ipc.py logs drops):
  1. It does not speak CURVE, or encrypts for another server key (it lacks the cluster
     key, or claims its public half without the secret): the handshake fails inside
     libzmq. The inbox's socket monitor sees it, but libzmq's monitor events name only our
     listening endpoint, not the peer's address, so the log cannot say who it was.
  2. It finishes the handshake with a key pair of its own: libzmq asks the context's ZAP
     handler (`_Gate`), which sees the peer's IP address and refuses every client key
     but the cluster's.

libzmq copies a socket's options into each listener when it binds, so the inbox binds
ipc first and only then turns on CURVE: the ipc listener stays plain.

Lifecycle: bind_inbox with a tcp_host starts the inbox's monitor and, for the first TCP
inbox of a context, the context's gate (ZAP has one fixed inproc endpoint per context);
both are tasks of the running event loop, with sockets of that context. Inbox.close
stops the monitor and, with the context's last TCP inbox, the gate, so that ctx.term()
finds nothing left open.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct

import zmq
import zmq.asyncio
from zmq.utils import z85

from lmd import ipc
from lmd.cluster.keys import ClusterKey

log = logging.getLogger(__name__)

_LOG_FIRST_REFUSALS = 10  # then every _LOG_EVERY_REFUSALS-th, like ipc.py's drops
_LOG_EVERY_REFUSALS = 1000
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZAP (RFC 27), one per context
_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
NOT_A_MEMBER = "it does not hold the cluster key"
_PROTOCOL_ERRORS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "it does not use CURVE (no cluster key)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: f"its CURVE handshake failed: {NOT_A_MEMBER}",
}


class Inbox(ipc.Channel):
    """A worker's inbox: a PULL channel on ipc, and on TCP behind CURVE when asked."""

    def __init__(self, socket: zmq.asyncio.Socket, label: str) -> None:
        super().__init__(socket, label)
        self.tcp_endpoint: str | None = None  # tcp://HOST:PORT as bound; None = ipc only
        self.num_refused = 0  # TCP connections refused for want of the cluster key
        self._gate: _Gate | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._watch: asyncio.Task[None] | None = None

    def refuse(self, peer: str | None, reason: str) -> None:
        """Count and log (rate-limited) a TCP connection that was not let in."""
        self.num_refused += 1
        n = self.num_refused
        if n <= _LOG_FIRST_REFUSALS or n % _LOG_EVERY_REFUSALS == 0:
            if peer:
                who = f"from {peer} to {self.label}"
            else:
                who = f"to {self.label} on {self.tcp_endpoint} (peer address not reported)"
            log.warning("refused a connection %s: %s (refusal #%d)", who, reason, n)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._monitor is not None and not self.socket.closed:
            self.socket.disable_monitor()
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self._gate is not None:
            self._gate.remove(self)
            self._gate = None
        super().close()

    def _listen_tcp(self, ctx: zmq.asyncio.Context, host: str, key: ClusterKey) -> None:
        sock = self.socket
        self._gate = gate = _Gate.of(ctx)
        domain = gate.add(self, key)
        self._monitor = monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES)
        self._watch = asyncio.create_task(self._watch_handshakes(monitor))
        # Set after the ipc bind: only the tcp listener gets them (see the docstring).
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, key.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain)
        if ":" in host:  # an IPv6 address
            sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        sock.bind(f"tcp://{host}:*")
        self.tcp_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def _watch_handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            head, endpoint = await monitor.recv_multipart()
            if not endpoint.startswith(b"tcp://"):
                continue  # a same-host ipc peer that broke off is no intruder
            event, value = struct.unpack("=HI", head)  # v1 monitor event: id, value
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                reason = _PROTOCOL_ERRORS.get(value, f"CURVE handshake error {value:#x}")
            else:  # EVENT_HANDSHAKE_FAILED_NO_DETAIL; value is an errno
                detail = os.strerror(value) if value else "no reason given"
                reason = f"the CURVE handshake did not finish ({detail})"
            self.refuse(None, reason)


class _Gate:
    """One context's ZAP handler: lets in CURVE clients whose key is the cluster's."""

    _of_context: dict[zmq.asyncio.Context, _Gate] = {}  # as libzmq: one per context

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._ctx = ctx
        self._socket = ctx.socket(zmq.ROUTER)
        try:
            self._socket.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError:  # EADDRINUSE: another ZAP handler (zmq.auth) holds the context
            self._socket.close(linger=0)
            raise
        self._inboxes: dict[bytes, tuple[Inbox, bytes]] = {}  # ZAP domain -> inbox, key
        self._num_added = 0
        self._task = asyncio.create_task(self._serve())

    @classmethod
    def of(cls, ctx: zmq.asyncio.Context) -> _Gate:
        gate = cls._of_context.get(ctx)
        if gate is None:
            gate = cls._of_context[ctx] = cls(ctx)
        return gate

    def add(self, inbox: Inbox, key: ClusterKey) -> bytes:
        """Guard `inbox`; returns the ZAP domain its TCP listener must carry."""
        self._num_added += 1
        domain = f"lmd-inbox-{self._num_added}".encode()
        self._inboxes[domain] = (inbox, z85.decode(key.public))  # ZAP gives raw keys
        return domain

    def remove(self, inbox: Inbox) -> None:
        self._inboxes = {d: v for d, v in self._inboxes.items() if v[0] is not inbox}
        if not self._inboxes:
            self._task.cancel()
            self._socket.close(linger=0)
            del self._of_context[self._ctx]

    async def _serve(self) -> None:
        while True:
            # ZAP request: version, request id, domain, address, identity, mechanism, creds
            identity, empty, _version, request_id, *request = await self._socket.recv_multipart()
            status, text = self._decide(request)
            reply = [identity, empty, b"1.0", request_id, status, text, b"", b""]
            await self._socket.send_multipart(reply)

    def _decide(self, request: list[bytes]) -> tuple[bytes, bytes]:
        if len(request) < 4:
            return b"500", b"malformed ZAP request"
        domain, address, _identity, mechanism, *credentials = request
        entry = self._inboxes.get(domain)
        if entry is None:  # a socket we did not set up, or an inbox being closed
            return b"400", b"unknown ZAP domain"
        inbox, public = entry
        if mechanism == b"CURVE" and credentials == [public]:
            return b"200", b"OK"
        inbox.refuse(address.decode("ascii", "replace"), NOT_A_MEMBER)
        return b"400", b"not a cluster member"


def bind_inbox(
    ctx: zmq.asyncio.Context,
    ipc_endpoint: str,
    label: str,
    tcp_host: str | None = None,
    key: ClusterKey | None = None,
) -> tuple[Inbox, str | None]:
    """A worker's inbox on `ipc_endpoint`, and on tcp://`tcp_host`:(a free port) too.

    Returns the channel and the TCP endpoint bound (None without tcp_host). With a
    tcp_host: needs the cluster key, and runs inside the event loop (the gate and the
    monitor are its tasks). Bind to the address other hosts use, not 0.0.0.0: the
    endpoint returned is what they are told.
    """
    if tcp_host is not None:
        if key is None:
            raise ValueError(f"{label}: a TCP inbox needs the cluster key (--cluster-key)")
        asyncio.get_running_loop()  # raises RuntimeError before any socket exists
    inbox = Inbox(ctx.socket(zmq.PULL), label)
    try:
        inbox.socket.bind(ipc_endpoint)
        if tcp_host is not None and key is not None:
            inbox._listen_tcp(ctx, tcp_host, key)
    except BaseException:
        inbox.close()
        raise
    return inbox, inbox.tcp_endpoint


def connect_push(
    ctx: zmq.asyncio.Context, endpoint: str, label: str, key: ClusterKey | None = None
) -> ipc.Channel:
    """A PUSH channel to an inbox: plain for ipc://, a CURVE client with `key` for tcp://."""
    if not endpoint.startswith("tcp://"):
        return ipc.connect_push(ctx, endpoint, label)
    if key is None:
        raise ValueError(f"{label}: {endpoint} is on another host and needs the cluster key")
    sock = ctx.socket(zmq.PUSH)
    try:
        # Every member holds the same pair: it is both our client key and the server's.
        sock.setsockopt(zmq.CURVE_SERVERKEY, key.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, key.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, key.secret)
        if endpoint.startswith("tcp://["):  # an IPv6 address
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return ipc.Channel(sock, label)
