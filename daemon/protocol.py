"""Every message that crosses a process boundary, and nothing else.

Wire format (ZeroMQ multipart): frame 0 is one type byte, frame 1 an orjson header
holding the message's JSON fields, and one further raw frame per `bytes` field (token ids
as little-endian int32, logprobs as float32), in declaration order. No pickle.

`decode` checks everything a peer could get wrong (type byte, header shape, field names
and types, frame count) and raises ProtocolError; receivers log, count and drop.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import orjson


class ProtocolError(ValueError):
    """A message that does not decode; the receiver drops it."""


class MsgType(enum.IntEnum):
    # worker -> supervisor
    READY = 1
    HEARTBEAT = 2
    # supervisor -> worker
    DRAIN = 10
    RESUME = 11
    STOP = 12
    CLUSTER_STATE = 13


@dataclass(frozen=True, slots=True)
class Ready:
    """A worker finished starting and serves its role."""

    TYPE: ClassVar[MsgType] = MsgType.READY
    name: str
    pid: int
    info: dict[str, Any]  # role facts shown in status (backend, device, ...)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent every heartbeat_interval; `stats` is what status shows for the worker."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    name: str
    inflight: int  # requests this worker still holds; 0 means a drain may finish
    num_dropped: int  # malformed or unexpected messages dropped since start
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop admitting new requests; finish what is in flight."""

    TYPE: ClassVar[MsgType] = MsgType.DRAIN


@dataclass(frozen=True, slots=True)
class Resume:
    """Admit new requests again after a drain."""

    TYPE: ClassVar[MsgType] = MsgType.RESUME


@dataclass(frozen=True, slots=True)
class Stop:
    """Exit now (after a drain, or when the daemon stops)."""

    TYPE: ClassVar[MsgType] = MsgType.STOP


@dataclass(frozen=True, slots=True)
class ClusterState:
    """The daemon's view of itself, pushed to every worker when it changes."""

    TYPE: ClassVar[MsgType] = MsgType.CLUSTER_STATE
    state: str  # DaemonState value
    missing_roles: list[str]  # roles with no running worker (why /health is 503)


Message = Union[Ready, Heartbeat, Drain, Resume, Stop, ClusterState]  # noqa: UP007
_MESSAGE_CLASSES: tuple[type[Any], ...] = typing.get_args(Message)


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kinds: tuple[type, ...]  # accepted JSON-decoded types


@dataclass(frozen=True, slots=True)
class _Schema:
    cls: type[Any]
    header: tuple[_Field, ...]
    frames: tuple[str, ...]  # names of the bytes fields, in frame order


def _kinds(hint: Any) -> tuple[type, ...]:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return tuple(k for arg in typing.get_args(hint) for k in _kinds(arg))
    if hint is type(None):
        return (type(None),)
    base = origin or hint
    if base is float:
        return (int, float)
    return (base,)


def _schema(cls: type[Any]) -> _Schema:
    hints = typing.get_type_hints(cls)
    header, frames = [], []
    for f in dataclasses.fields(cls):
        if hints[f.name] is bytes:
            frames.append(f.name)
        else:
            header.append(_Field(f.name, _kinds(hints[f.name])))
    return _Schema(cls, tuple(header), tuple(frames))


_SCHEMAS: dict[int, _Schema] = {int(c.TYPE): _schema(c) for c in _MESSAGE_CLASSES}


def encode(msg: Message) -> list[bytes]:
    schema = _SCHEMAS[int(msg.TYPE)]
    header = {f.name: getattr(msg, f.name) for f in schema.header}
    frames = [bytes((int(msg.TYPE),)), orjson.dumps(header)]
    frames.extend(getattr(msg, name) for name in schema.frames)
    return frames


def _type_ok(value: Any, kinds: tuple[type, ...]) -> bool:
    # bool is an int in Python, but a JSON true is never a valid count.
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


def decode(frames: list[bytes]) -> Message:
    """Parse a multipart message; raise ProtocolError saying what is wrong."""
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames, got {len(frames)}")
    if len(frames[0]) != 1:
        raise ProtocolError(f"type frame must be 1 byte, got {len(frames[0])}")
    schema = _SCHEMAS.get(frames[0][0])
    if schema is None:
        raise ProtocolError(f"unknown message type {frames[0][0]}")
    name = schema.cls.__name__
    if len(frames) != 2 + len(schema.frames):
        raise ProtocolError(f"{name}: expected {2 + len(schema.frames)} frames, got {len(frames)}")
    try:
        header = orjson.loads(frames[1])
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"{name}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"{name}: header must be a JSON object")
    expected = {f.name for f in schema.header}
    if set(header) != expected:
        raise ProtocolError(f"{name}: header keys {sorted(header)} != {sorted(expected)}")
    for f in schema.header:
        if not _type_ok(header[f.name], f.kinds):
            raise ProtocolError(f"{name}.{f.name}: wrong type {type(header[f.name]).__name__}")
    raw = dict(zip(schema.frames, frames[2:], strict=True))
    msg: Message = schema.cls(**header, **raw)
    return msg
