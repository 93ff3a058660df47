"""The wire format of lmd.protocol's messages: a message is a frozen dataclass with a
`TYPE` byte; it travels as ZeroMQ multipart frames.

Frame 0 is the type byte, frame 1 an orjson header holding the message's JSON fields, and
one further raw frame per `bytes` field (token ids as little-endian int32, logprobs as
float32), in declaration order. Nothing is pickled. `Codec.decode` checks the type
byte, the size against the kind's cap (before parsing anything), the frame count, the
header's keys and the JSON type of every field (and of every element of a typed list),
then runs the message's own `check()` if it has one.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import orjson


class ProtocolError(ValueError):
    """A message that does not decode; the receiver drops it."""


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes (the wire form)."""
    out = array("i", ids)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def unpack_ids(raw: bytes) -> list[int]:
    ids = array("i")
    ids.frombytes(raw)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tolist()


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kinds: frozenset[type]  # accepted JSON-decoded types
    item_kinds: frozenset[type] | None  # for list[X]: accepted types of each element


@dataclass(frozen=True, slots=True)
class _Schema:
    cls: type[Any]
    header: tuple[_Field, ...]
    frames: tuple[str, ...]  # names of the bytes fields, in frame order
    keys: frozenset[str]  # the header's field names
    max_bytes: int  # all frames together


def _kinds(hint: Any) -> frozenset[type]:
    """The exact types a JSON value of this hint decodes to (orjson makes no subclasses,
    and a JSON true is a bool, never a valid int or float)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return frozenset(k for arg in typing.get_args(hint) for k in _kinds(arg))
    if hint is type(None):
        return frozenset((type(None),))
    base = origin or hint
    if base is float:
        return frozenset((int, float))
    return frozenset((base,))


def _schema(cls: type[Any], max_bytes: int) -> _Schema:
    hints = typing.get_type_hints(cls)
    header, frames = [], []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if hint is bytes:
            frames.append(f.name)
            continue
        args = typing.get_args(hint)
        is_typed_list = typing.get_origin(hint) is list and args and args[0] is not Any
        items = _kinds(args[0]) if is_typed_list else None
        header.append(_Field(f.name, _kinds(hint), items))
    keys = frozenset(f.name for f in header)
    return _Schema(cls, tuple(header), tuple(frames), keys, max_bytes)


class Codec:
    """Encodes and decodes the messages of `classes` (each with a distinct TYPE byte);
    `max_bytes`: the size cap of each type byte (every class needs one)."""

    def __init__(self, classes: Sequence[type[Any]], max_bytes: Mapping[int, int]) -> None:
        self._schemas = {int(c.TYPE): _schema(c, max_bytes[int(c.TYPE)]) for c in classes}
        if len(self._schemas) != len(classes):
            raise ValueError("two message classes share a type byte")

    def oversize(self, frames: list[bytes]) -> str | None:
        """Why an encoded message is over its kind's cap; None when it fits."""
        schema = self._schemas[frames[0][0]]
        size = sum(map(len, frames))
        if size <= schema.max_bytes:
            return None
        cap = schema.max_bytes
        return f"{schema.cls.__name__} of {size:,} bytes is over its cap of {cap:,} bytes"

    def encode(self, msg: Any) -> list[bytes]:
        schema = self._schemas[int(msg.TYPE)]
        header = {f.name: getattr(msg, f.name) for f in schema.header}
        frames = [bytes((int(msg.TYPE),)), orjson.dumps(header)]
        frames.extend(getattr(msg, name) for name in schema.frames)
        return frames

    def decode(self, frames: list[bytes]) -> Any:
        """Parse a multipart message; raise ProtocolError saying what is wrong."""
        if len(frames) < 2:
            raise ProtocolError(f"expected at least 2 frames, got {len(frames)}")
        if len(frames[0]) != 1:
            raise ProtocolError(f"type frame must be 1 byte, got {len(frames[0])}")
        schema = self._schemas.get(frames[0][0])
        if schema is None:
            raise ProtocolError(f"unknown message type {frames[0][0]}")
        name = schema.cls.__name__
        if sum(map(len, frames)) > schema.max_bytes:  # before any parsing
            raise ProtocolError(self.oversize(frames) or name)
        if len(frames) != 2 + len(schema.frames):
            raise ProtocolError(
                f"{name}: expected {2 + len(schema.frames)} frames, got {len(frames)}"
            )
        try:
            header = orjson.loads(frames[1])
        except orjson.JSONDecodeError as exc:
            raise ProtocolError(f"{name}: header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ProtocolError(f"{name}: header must be a JSON object")
        if header.keys() != schema.keys:
            raise ProtocolError(f"{name}: header keys {sorted(header)} != {sorted(schema.keys)}")
        for f in schema.header:
            value = header[f.name]
            # Exact types, compared in C: a TextDelta's lists hold one entry per request
            # and token, and this runs for every message on the data path.
            if type(value) not in f.kinds:
                raise ProtocolError(f"{name}.{f.name}: wrong type {type(value).__name__}")
            if f.item_kinds is not None and not f.item_kinds.issuperset(map(type, value)):
                raise ProtocolError(f"{name}.{f.name}: an element has the wrong type")
        raw = dict(zip(schema.frames, frames[2:], strict=True))
        msg = schema.cls(**header, **raw)
        check = getattr(msg, "check", None)
        if check is not None:
            check()
        return msg
