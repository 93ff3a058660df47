"""Message type bytes, and the field checks several messages share."""

from __future__ import annotations

import enum

from lmd.names import WORKER_NAME
from lmd.wire import ProtocolError


class MsgType(enum.IntEnum):
    # worker -> supervisor
    READY = 1
    HEARTBEAT = 2
    # supervisor -> worker
    DRAIN = 10
    RESUME = 11
    STOP = 12
    CLUSTER_STATE = 13
    RECONFIGURE = 14
    # data path
    GENERATE = 20
    ABORT = 21
    TOKENS = 22
    REQUEST_ERROR = 23
    TEXT_REQUEST = 24
    TEXT_DELTA = 25
    SESSION_CONTROL = 26
    # KV migration, prefill <-> decode (docs/architecture.md §1, steps 3-4)
    RESERVE = 30
    RESERVED = 31
    MIGRATED = 32
    RELEASE = 33


def check_name(cls: str, field: str, value: str) -> None:
    if not WORKER_NAME.fullmatch(value):
        raise ProtocolError(f"{cls}.{field} {value[:40]!r} is not a worker name")


def check_ids(cls: str, field: str, value: bytes) -> None:
    if not value or len(value) % 4:
        raise ProtocolError(f"{cls}.{field} must be a non-empty int32 array")
