"""This node's key in etcd: its signed record under a lease, written only while it is ours.

Life cycle (driven by Membership's tasks; every call may raise an aetcd error when etcd
does not answer, and the caller retries):
1. `register()` grants a lease (unless it holds one) and puts the newest record only if
   the key is absent: a transaction on create_revision == 0. The key's create revision
   then identifies it as ours. A key that exists belongs to another live supervisor of
   the same node name: `register` returns why, in one line.
2. `keep_alive()`, every ttl/3: refreshes the lease; when etcd answers that the lease is
   gone (it expired during an outage, or etcd lost its data), drops it and registers
   again with the newest record.
3. `put()` writes the newest record, only while the key still has our create revision
   (never over another node's key, and never bringing back a key that expired).
4. `revoke()` ends the lease: etcd deletes the key at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from lmd.cluster.records import NodeRecord, seal, unseal

log = logging.getLogger(__name__)


class Registration:
    def __init__(
        self, client: Any, key: bytes, record: NodeRecord, secret: bytes, ttl_s: float
    ) -> None:
        self.key = key
        self.record = record  # the newest; set by Membership.publish
        self._client = client  # aetcd.Client (aetcd ships no type information)
        self._secret = secret
        self._lease: Any = None  # aetcd.Lease; None until granted and once lost
        self.ttl_s = max(1, math.ceil(ttl_s))  # as etcd grants it: whole seconds
        self._create_revision = 0  # of our key while it is ours; 0: not registered
        self._write_lock = asyncio.Lock()  # one write of our key at a time

    @property
    def registered(self) -> bool:
        return self._create_revision != 0

    async def register(self) -> str | None:
        """Put the newest record if our key is absent: None, or why the name is taken."""
        client, txn = self._client, self._client.transactions
        if self._lease is None:
            self._lease = await client.lease(self.ttl_s)
            self.ttl_s = max(1, int(self._lease.ttl))
        async with self._write_lock:
            ok, responses = await client.transaction(
                compare=[txn.create(self.key) == 0],
                success=[txn.put(self.key, seal(self.record, self._secret), lease=self._lease)],
                failure=[txn.get(self.key)],
            )
            if ok:  # a key created in a transaction has the transaction's revision
                self._create_revision = int(responses[0].response_put.header.revision)
                return None
            value, kv = responses[0][0]  # the comparison failed: the key exists
            if kv.lease == self._lease.id:  # ours: the answer to an earlier try was lost
                self._create_revision = int(kv.create_revision)
                return None
        node = self.record.node
        try:
            holder = unseal(value, self._secret)
        except ValueError as exc:
            return f"node name {node} is already registered in etcd, and {exc}"
        return (
            f"node name {node} is already registered by pid {holder.pid} on host "
            f"{holder.host}; if that process is gone, retry when its lease expires "
            f"(within {self.ttl_s} s)"
        )

    async def keep_alive(self) -> str | None:
        """Refresh the lease; register again if it was lost. None, or why the name is taken."""
        if self._lease is not None:
            reply = await self._lease.refresh()
            if reply is None:
                raise ConnectionError("etcd sent no keep-alive reply")
            if reply.TTL <= 0:
                log.warning("lease lost, registering again (node %s)", self.record.node)
                self._lease, self._create_revision = None, 0
        return None if self.registered else await self.register()

    async def put(self) -> None:
        """Write the newest record, if our key is still ours (else keep_alive registers)."""
        client, txn = self._client, self._client.transactions
        async with self._write_lock:
            if not self.registered:
                return  # keep_alive registers again, with the newest record
            ok, _ = await client.transaction(
                compare=[txn.create(self.key) == self._create_revision],
                success=[txn.put(self.key, seal(self.record, self._secret), lease=self._lease)],
                failure=[],
            )
            if not ok:  # our key is gone (the lease expired) or was taken
                self._create_revision = 0

    async def revoke(self) -> None:
        """End the lease (etcd deletes our key at once); nothing if there is none."""
        lease, self._lease, self._create_revision = self._lease, None, 0
        if lease is not None:
            await lease.revoke()
