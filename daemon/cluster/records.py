"""Node records in etcd: one node's signed record, and the set that a node sees. Pure.

Each node supervisor keeps one key, `<prefix><node>`, whose value is

    {"record": "<NodeRecord JSON, as a string>", "mac": "<hex HMAC-SHA256>"}

The MAC is HMAC-SHA256 keyed by the cluster secret over the record's JSON bytes exactly as
stored (the record travels as a string so that no re-encoding can change those bytes). A
node without the secret can write to etcd but cannot produce a record that the others
accept, so it cannot join.

`NodeRecords` is the set of them one node sees, fed by the membership's watch task:
`replace` with a full read of the prefix (at start and after every reconnect, so that
nothing missed during an outage lingers), then `put` and `delete` for each watch event.
A value that does not verify or parse is left out and logged once per node (until that
node's key goes away or turns valid). `on_change` callbacks run whenever the set changes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmd.names import NODE_NAME

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What one node tells the others: where it is, its state, and its workers."""

    node: str  # node name, [A-Za-z0-9_]{1,32}
    host: str  # the address other hosts reach this node at
    pid: int  # the node supervisor's pid
    state: str  # the daemon state: "starting", "running", "draining", "stopping"
    # worker name -> JSON-able facts (role, pid, endpoint, load ...); opaque here
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.node, str) or NODE_NAME.fullmatch(self.node) is None:
            raise ValueError(f"node name {self.node!r} is not 1-32 of [A-Za-z0-9_]")
        if not isinstance(self.host, str):
            raise ValueError(f"node {self.node}: host must be a string")
        if isinstance(self.pid, bool) or not isinstance(self.pid, int) or self.pid <= 0:
            raise ValueError(f"node {self.node}: pid must be a positive integer")
        if not isinstance(self.state, str) or not self.state:
            raise ValueError(f"node {self.node}: state must be a non-empty string")
        if not isinstance(self.workers, dict) or not all(
            isinstance(name, str) and isinstance(facts, dict)
            for name, facts in self.workers.items()
        ):
            raise ValueError(f"node {self.node}: workers must map names to objects")

    def to_json(self) -> bytes:
        """Compact JSON with sorted keys; TypeError if a worker fact is not JSON-able."""
        doc = {
            "node": self.node,
            "host": self.host,
            "pid": self.pid,
            "state": self.state,
            "workers": self.workers,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> NodeRecord:
        """The record in data; ValueError on anything malformed (unknown keys are ignored)."""
        doc = json.loads(data)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if not isinstance(doc, dict):
            raise ValueError("a node record must be a JSON object")
        missing = {"node", "host", "pid", "state", "workers"} - doc.keys()
        if missing:
            raise ValueError(f"a node record lacks {', '.join(sorted(missing))}")
        return cls(doc["node"], doc["host"], doc["pid"], doc["state"], doc["workers"])


def record_mac(secret: bytes, record_json: bytes) -> str:
    return hmac.new(secret, record_json, hashlib.sha256).hexdigest()


def seal(record: NodeRecord, secret: bytes) -> bytes:
    """The value stored in etcd for record: the record's JSON and its MAC."""
    record_json = record.to_json()
    doc = {"record": record_json.decode(), "mac": record_mac(secret, record_json)}
    return json.dumps(doc, separators=(",", ":")).encode()


def unseal(value: bytes, secret: bytes) -> NodeRecord:
    """The record in an etcd value; ValueError (a reason to log) unless its MAC verifies."""
    try:
        doc = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"its value is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError("its value is not a JSON object")
    record_json, mac = doc.get("record"), doc.get("mac")
    if not isinstance(record_json, str) or not isinstance(mac, str):
        raise ValueError("its value lacks a record and a mac")
    data = record_json.encode()
    if not hmac.compare_digest(mac.encode(), record_mac(secret, data).encode()):
        raise ValueError("its record is not signed with this cluster's key")
    try:
        return NodeRecord.from_json(data)
    except ValueError as exc:
        raise ValueError(f"its record is malformed ({exc})") from None


class NodeRecords:
    """Node name -> record, for every verified record under an etcd prefix."""

    def __init__(self, prefix: str, secret: bytes) -> None:
        self.prefix = prefix
        self._secret = secret
        self._records: dict[str, NodeRecord] = {}
        self._ignored: set[str] = set()  # nodes whose bad record was logged
        self._callbacks: list[Callable[[], None]] = []

    @property
    def records(self) -> dict[str, NodeRecord]:
        """Node name -> record (a copy)."""
        return dict(self._records)

    def on_change(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def replace(self, values: dict[bytes, bytes]) -> None:
        """Everything under the prefix now: key -> value."""
        records: dict[str, NodeRecord] = {}
        for key, value in values.items():
            record = self._verify(key, value)
            if record is not None:
                records[record.node] = record
        self._ignored &= {self._name(key) for key in values}
        self._set(records)

    def put(self, key: bytes, value: bytes) -> None:
        records = dict(self._records)
        record = self._verify(key, value)
        if record is None:
            records.pop(self._name(key), None)
        else:
            records[record.node] = record
        self._set(records)

    def delete(self, key: bytes) -> None:
        name = self._name(key)
        self._ignored.discard(name)
        records = dict(self._records)
        records.pop(name, None)
        self._set(records)

    def _name(self, key: bytes) -> str:
        return key[len(self.prefix) :].decode(errors="replace")

    def _verify(self, key: bytes, value: bytes) -> NodeRecord | None:
        """The record in value, or None after logging (once per node) why it is left out."""
        name = self._name(key)
        try:
            record = unseal(value, self._secret)
            if record.node != name:
                raise ValueError(f"its record is for node {record.node}")
        except ValueError as exc:
            if name not in self._ignored:
                self._ignored.add(name)
                log.warning("ignoring node %s in etcd: %s", name, exc)
            return None
        self._ignored.discard(name)
        return record

    def _set(self, records: dict[str, NodeRecord]) -> None:
        if records == self._records:
            return
        self._records = records
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception:
                log.exception("a membership on_change callback failed")
