"""What a nixl region's descriptor carries, and how NIXL names a byte range.

A descriptor is what decode sends in Reserved: MAGIC, the JSON header's length
(HEADER_LEN), the JSON header {"agent", "addr", "size", "device", "mem"} (the agent's
name and the registered range) and the agent's metadata as NIXL exports it (UCX worker
address and memory keys, opaque). `parse` checks everything but the metadata, which
NIXL itself checks when it loads it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import orjson

MAGIC = b"lmd-nixl\x01"
HEADER_LEN = struct.Struct("<I")  # bytes of the JSON header after the magic
MEMORY_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True, slots=True)
class Span:
    """A registered byte range as NIXL names it: address, length, device, memory type."""

    addr: int
    size: int
    device: int  # the GPU's index; 0 for host memory
    mem: str  # "DRAM" (host) or "VRAM" (GPU)

    @classmethod
    def on(cls, device: str, addr: int, size: int) -> Span:
        """The span of `size` bytes at `addr` on "cpu" or "cuda:N"; ValueError otherwise."""
        if size < 1:
            raise ValueError(f"region size must be >= 1, got {size}")
        if device == "cpu":
            return cls(addr, size, 0, "DRAM")
        index = device.removeprefix("cuda:")
        if not index.isdigit():
            raise ValueError(f"the nixl transport registers cpu or cuda:N memory, not {device}")
        return cls(addr, size, int(index), "VRAM")


def encode(agent: str, metadata: bytes, span: Span) -> bytes:
    header = orjson.dumps(
        {
            "agent": agent,
            "addr": span.addr,
            "size": span.size,
            "device": span.device,
            "mem": span.mem,
        }
    )
    return MAGIC + HEADER_LEN.pack(len(header)) + header + metadata


def parse(descriptor: bytes) -> tuple[str, bytes, Span]:
    """(agent name, agent metadata, span) of a descriptor; ValueError if malformed."""
    head = len(MAGIC) + HEADER_LEN.size
    if not descriptor.startswith(MAGIC) or len(descriptor) < head:
        raise ValueError("not a nixl transport descriptor")
    (length,) = HEADER_LEN.unpack_from(descriptor, len(MAGIC))
    if head + length >= len(descriptor):
        raise ValueError("truncated nixl transport descriptor")
    try:
        header = orjson.loads(descriptor[head : head + length])
        agent, mem = header["agent"], header["mem"]
        addr, size, device = (header[k] for k in ("addr", "size", "device"))
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed nixl transport descriptor: {exc}") from None
    if not isinstance(agent, str) or not agent or mem not in MEMORY_TYPES:
        raise ValueError("malformed nixl transport descriptor: agent or memory type")
    if not all(type(n) is int and 0 <= n < 1 << 64 for n in (addr, size, device)) or size < 1:
        raise ValueError("malformed nixl transport descriptor: address, size or device")
    return agent, descriptor[head + length :], Span(addr, size, device, mem)
