"""Cluster membership through etcd: which nodes are alive, and what workers each runs.

Life cycle of a Membership (one per node supervisor):
1. `Membership(url, node, secret)` checks its arguments; nothing is contacted yet.
2. `await start(record)` connects and registers: a lease of ttl_s, and our signed record
   at `<prefix><node>` only if that key is absent (registration.py). A live supervisor
   already using the name, or an etcd that does not answer within 5 s, is a
   MembershipError. It then reads the prefix (so `view` is right on return) and starts
   three tasks:
   - keep-alive: refreshes the lease every ttl/3; when etcd says the lease is gone (it
     expired during an outage, or etcd lost its data), grants a new one and registers
     again with the newest record;
   - publisher: puts the newest record given to `publish()`; bursts coalesce into one
     put, and one put at a time is in flight;
   - watch: follows the prefix from the revision it read; on any error it reads the
     whole prefix again (a full resync) and watches from there.
3. `view` holds every live node whose record verifies with the cluster secret, ours
   included; `on_change` callbacks run (in the loop) whenever it changes. While etcd is
   unreachable, `view` keeps the last known state (logged as stale) and `connected`
   is False.
4. `await stop()` cancels the tasks, revokes the lease (the others see us leave at once
   rather than after ttl_s) and closes the client. It never raises; a second call does
   nothing.

A node that dies without stop() (kill -9) stops refreshing its lease: etcd deletes its
key when the lease expires, within ttl_s (+0.5 s, etcd's expiry check), and every
watcher drops it from its view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from typing import Any

from lmd.cluster.records import NodeRecord, NodeRecords
from lmd.cluster.registration import Registration
from lmd.names import NODE_NAME

__all__ = ["Membership", "MembershipError", "NodeRecord", "parse_etcd_url"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # start() gives up on an etcd that does not answer
RPC_TIMEOUT_S = 5.0  # any one etcd call
RETRY_S = 0.5  # between attempts while etcd is unreachable
STOP_TIMEOUT_S = 2.0  # stop(): revoking the lease, closing the client
# gRPC channel: notice a dead connection (etcd refuses pings more often than every 5 s),
# and retry a lost one at least every second (gRPC's default backoff grows to 120 s).
GRPC_OPTIONS = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1_000,
}

_URL = re.compile(r"etcd://(?P<host>[^:/\s]+):(?P<port>\d{1,5})")


class MembershipError(RuntimeError):
    """The node cannot join the cluster; the message says why, in one line."""


def parse_etcd_url(url: str) -> tuple[str, int]:
    """(host, port) from "etcd://HOST:PORT"; ValueError for anything else."""
    match = _URL.fullmatch(url)
    port = int(match["port"]) if match else 0
    if match is None or not 0 < port < 65536:
        raise ValueError(f"cluster address {url!r} is not etcd://HOST:PORT")
    return match["host"], port


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return "no answer in time"
    return " ".join(str(exc).split()) or type(exc).__name__


class Membership:
    """This node's registration in etcd, and the view of every live node's record."""

    def __init__(
        self, url: str, node: str, secret: bytes, ttl_s: float = 3.0, prefix: str = "/lmd/nodes/"
    ) -> None:
        self.host, self.port = parse_etcd_url(url)
        if NODE_NAME.fullmatch(node) is None:
            raise ValueError(f"node name {node!r} is not 1-32 of [A-Za-z0-9_]")
        if not secret:
            raise ValueError("the cluster secret is empty")
        if not ttl_s > 0:
            raise ValueError(f"membership ttl_s must be positive, not {ttl_s}")
        if not prefix.endswith("/"):
            raise ValueError(f"etcd key prefix {prefix!r} must end with /")
        self.node = node
        self.ttl_s = ttl_s
        self.prefix = prefix
        self._secret = secret
        self._nodes = NodeRecords(prefix, secret)
        self._client: Any = None  # aetcd.Client (aetcd ships no type information)
        self._registration: Registration | None = None
        self._dirty = asyncio.Event()  # publish() gave a record not yet put
        self._tasks: list[asyncio.Task[None]] = []
        self._lease_alive = False
        self._watching = False
        self._stale = False  # an outage was logged; log when it ends
        self._taken_logged = False
        self._started = False
        self._stopped = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def view(self) -> dict[str, NodeRecord]:
        """Node name -> record: every live node with a valid signature, ours included."""
        return self._nodes.records

    @property
    def connected(self) -> bool:
        """Our lease is alive (our record is in etcd) and the watch is running."""
        return self._lease_alive and self._watching

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call callback (in the loop, with no arguments) whenever `view` changes."""
        self._nodes.on_change(callback)

    async def start(self, record: NodeRecord) -> None:
        """Register record (put-if-absent under a new lease), read the view, start the tasks."""
        self._check_own(record)
        if self._started:
            raise RuntimeError("Membership.start() may be called once")
        self._started = True
        try:
            import aetcd
        except ImportError:
            raise MembershipError(
                "cluster mode needs the etcd client: pip install 'lmd[cluster]'"
            ) from None
        self._client = aetcd.Client(
            self.host, self.port, timeout=RPC_TIMEOUT_S, options=GRPC_OPTIONS
        )
        key = f"{self.prefix}{self.node}".encode()
        self._registration = Registration(self._client, key, record, self._secret, self.ttl_s)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                taken = await self._registration.register()
                watch = await self._open_watch() if taken is None else None
        except Exception as exc:
            await self._release()  # a registration made before the failure goes at once
            reason = _one_line(exc)
            if isinstance(exc, TimeoutError):
                reason = f"no answer within {CONNECT_TIMEOUT_S:g} s"
            raise MembershipError(f"cannot reach etcd at {self.address}: {reason}") from None
        if taken is not None:
            await self._release()
            raise MembershipError(taken)
        self._lease_alive = self._watching = True
        self._tasks = [
            asyncio.create_task(self._keepalive_loop(), name=f"membership-keepalive-{self.node}"),
            asyncio.create_task(self._publish_loop(), name=f"membership-publish-{self.node}"),
            asyncio.create_task(self._watch_loop(watch), name=f"membership-watch-{self.node}"),
        ]

    def publish(self, record: NodeRecord) -> None:
        """Remember record as ours; the publisher puts the newest one soon. Never blocks."""
        self._check_own(record)
        if self._registration is None:
            raise RuntimeError("Membership.publish() before start()")
        self._registration.record = record
        self._dirty.set()

    async def stop(self) -> None:
        """Leave the cluster at once (revoke the lease) and release everything. Never raises."""
        if self._stopped:
            return
        self._stopped = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._lease_alive = self._watching = False
        await self._release()

    def _check_own(self, record: NodeRecord) -> None:
        if record.node != self.node:
            raise ValueError(f"record of node {record.node!r} given to node {self.node!r}")

    # -- our record: the keep-alive and publisher tasks

    async def _keepalive_loop(self) -> None:
        assert self._registration is not None
        while True:
            await asyncio.sleep(self._registration.ttl_s / 3)
            try:  # unanswered for ttl since the last refresh: the lease may be gone
                async with asyncio.timeout(self._registration.ttl_s * 2 / 3):
                    taken = await self._registration.keep_alive()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._lease_alive = False
                self._note_outage("keep-alive", exc)
                continue
            self._lease_alive = taken is None
            if taken is None:
                self._taken_logged = False
                self._note_recovery()
            elif not self._taken_logged:
                self._taken_logged = True
                log.error("this node is out of the cluster until the name is free: %s", taken)

    async def _publish_loop(self) -> None:
        assert self._registration is not None
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._registration.put()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("node %s: publishing to etcd failed (%s); retrying", self.node, exc)
                self._dirty.set()
                await asyncio.sleep(RETRY_S)

    # -- the view: the watch task

    async def _open_watch(self) -> Any:
        """Read the whole prefix into the view (a full resync); watch from the next revision."""
        prefix = self.prefix.encode()
        got = await self._client.get_prefix(prefix)
        self._nodes.replace({bytes(kv.key): bytes(kv.value) for kv in got})
        return await self._client.watch_prefix(prefix, start_revision=got.header.revision + 1)

    async def _watch_loop(self, watch: Any) -> None:
        while True:
            try:
                if watch is None:
                    watch = await self._open_watch()
                    self._watching = True
                    self._note_recovery()
                async for event in watch:
                    if event.kind == "PUT":
                        self._nodes.put(bytes(event.kv.key), bytes(event.kv.value))
                    else:
                        self._nodes.delete(bytes(event.kv.key))
                raise ConnectionError("the watch ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._watching = False
                self._note_outage("watch", exc)
            watch = None
            await asyncio.sleep(RETRY_S)

    # -- outages, and the end

    def _note_outage(self, what: str, exc: BaseException) -> None:
        if self._stale:
            log.debug("node %s: etcd %s failed: %s", self.node, what, _one_line(exc))
            return
        self._stale = True
        log.warning(
            "etcd at %s is unreachable (%s: %s); membership is stale: keeping the last "
            "known %d node(s) until it answers again",
            self.address,
            what,
            _one_line(exc),
            len(self._nodes.records),
        )

    def _note_recovery(self) -> None:
        if self._stale and self.connected:
            self._stale = False
            log.info("etcd at %s answers again; membership is current", self.address)

    async def _release(self) -> None:
        """Revoke the lease (our key goes at once), then close the client."""
        if self._registration is not None:
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self._registration.revoke()
            except Exception as exc:
                log.warning(
                    "could not revoke this node's etcd lease (%s): the other nodes see it "
                    "leave when the lease expires, within %d s",
                    _one_line(exc),
                    self._registration.ttl_s,
                )
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await client.close()
