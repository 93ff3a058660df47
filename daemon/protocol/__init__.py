"""Every message that crosses a process boundary, and nothing else.

How a message becomes frames is wire.py's (type byte, orjson header, raw frames; nothing
pickled). `decode` checks everything a peer could get wrong (type byte, size against
the kind's cap in kinds.MAX_BYTES, header shape, field names and types, frame count,
then each message's own `check`) and raises ProtocolError; receivers log, count and
drop. A data message's `PEERS` are its fields that name workers (`peer_names`): a worker
takes it only when it knows them all (Worker.knows). The messages live by path: `control`
(supervisor <-> workers), `requests` (the data path), `migration` (prefill <-> decode);
everything is used as `protocol.Name`. `roles` holds the `Role` values messages carry.
"""

from __future__ import annotations

import typing
from typing import Union

from lmd.protocol.control import (
    ClusterState,
    Drain,
    Heartbeat,
    Ready,
    Reconfigure,
    Resume,
    Stop,
)
from lmd.protocol.kinds import MAX_BYTES, MAX_FRAME_BYTES, MsgType
from lmd.protocol.migration import Migrated, Release, Reserve, Reserved
from lmd.protocol.requests import (
    MAX_CHOICES,
    SESSION_ACTIONS,
    Abort,
    Detokenize,
    Generate,
    RequestError,
    SessionControl,
    TextDelta,
    TextRequest,
    Tokenize,
    Tokenized,
    Tokens,
)
from lmd.protocol.roles import CLUSTER_ROLES, ENGINE_ROLES, SCALABLE_ROLES, Role
from lmd.wire import Codec, ProtocolError, pack_ids, unpack_ids

__all__ = [
    "CLUSTER_ROLES",
    "ENGINE_ROLES",
    "MAX_BYTES",
    "MAX_CHOICES",
    "MAX_FRAME_BYTES",
    "SCALABLE_ROLES",
    "SESSION_ACTIONS",
    "Abort",
    "ClusterState",
    "Detokenize",
    "Drain",
    "Generate",
    "Heartbeat",
    "Message",
    "Migrated",
    "MsgType",
    "ProtocolError",
    "Ready",
    "Reconfigure",
    "Release",
    "RequestError",
    "Reserve",
    "Reserved",
    "Resume",
    "Role",
    "SessionControl",
    "Stop",
    "TextDelta",
    "TextRequest",
    "Tokenize",
    "Tokenized",
    "Tokens",
    "decode",
    "encode",
    "oversize",
    "pack_ids",
    "peer_names",
    "unpack_ids",
]

Message = Union[  # noqa: UP007
    Ready,
    Heartbeat,
    Drain,
    Resume,
    Stop,
    Reconfigure,
    ClusterState,
    Generate,
    Abort,
    Tokens,
    RequestError,
    TextRequest,
    TextDelta,
    SessionControl,
    Tokenize,
    Detokenize,
    Tokenized,
    Reserve,
    Reserved,
    Migrated,
    Release,
]


_CODEC = Codec(typing.get_args(Message), MAX_BYTES)


def encode(msg: Message) -> list[bytes]:
    return _CODEC.encode(msg)


def decode(frames: list[bytes]) -> Message:
    """Parse a multipart message; raise ProtocolError saying what is wrong."""
    msg: Message = _CODEC.decode(frames)
    return msg


def oversize(frames: list[bytes]) -> str | None:
    """Why an encoded message is over its kind's cap (kinds.MAX_BYTES); None if it fits."""
    return _CODEC.oversize(frames)


def peer_names(msg: Message) -> list[str]:
    """The workers a data message names (its `PEERS` fields that are set): who the
    receiver will answer or talk to about it."""
    return [name for field in getattr(msg, "PEERS", ()) if (name := getattr(msg, field))]
