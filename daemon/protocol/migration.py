"""KV migration, prefill <-> decode: reserve, reserved, migrated, release.

The protocol is docs/architecture.md §1, steps 3-4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lmd.protocol.kinds import MsgType, check_ids, check_name
from lmd.wire import ProtocolError, unpack_ids

MAX_RANKS = 8  # the largest tensor-parallel group (engine.parallel.MAX_TP)


@dataclass(frozen=True, slots=True)
class Reserve:
    """prefill -> decode: hold KV blocks for this prompt (step 1 of a migration).

    Decode answers Reserved once the blocks are allocated (it may queue the request
    until they free up), or RequestError when it cannot take the request at all.
    """

    TYPE: ClassVar[MsgType] = MsgType.RESERVE
    PEERS: ClassVar[tuple[str, ...]] = ("prefill", "reply_to")  # protocol.peer_names
    request_id: str
    prefill: str  # the sender; Reserved and errors go back to it
    reply_to: str  # where decode streams the tokens (the tokenizer)
    sampling: dict[str, Any]  # SamplingParams fields
    prompt: bytes  # token ids, int32 little-endian

    def check(self) -> None:
        check_ids("Reserve", "prompt", self.prompt)
        check_name("Reserve", "prefill", self.prefill)
        check_name("Reserve", "reply_to", self.reply_to)

    @property
    def prompt_token_ids(self) -> list[int]:
        return unpack_ids(self.prompt)


@dataclass(frozen=True, slots=True)
class Reserved:
    """decode -> prefill: blocks allocated for a request (step 2 of a migration).

    `block_ids[i]` receives the prompt's i-th block. The first `num_cached_blocks` of
    them already hold that KV (decode's prefix cache): prefill does not copy those.
    `descriptor` opens decode's KV pool with the migration transport; prefill checks
    `block_nbytes` against its own pool and every id against the pool's size. A decode
    worker that is a tensor-parallel group of N sends every rank's descriptor, one after
    the other in `descriptor`, their lengths in `rank_descriptors` (rank 0 first; []
    for a decode worker of one process), and a rank's `block_nbytes` (its heads' share).
    """

    TYPE: ClassVar[MsgType] = MsgType.RESERVED
    PEERS: ClassVar[tuple[str, ...]] = ("decode",)  # protocol.peer_names
    request_id: str
    decode: str  # the sender
    transport: str  # host or cuda_ipc
    block_nbytes: int
    num_blocks: int  # blocks in decode's pool
    num_cached_blocks: int
    rank_descriptors: list[int]  # each decode rank's descriptor length; [] = one process
    descriptor: bytes
    block_ids: bytes  # int32 little-endian

    def check(self) -> None:
        check_name("Reserved", "decode", self.decode)
        check_ids("Reserved", "block_ids", self.block_ids)
        if not self.descriptor:
            raise ProtocolError("Reserved.descriptor is empty")
        sizes = self.rank_descriptors
        if sizes and (
            len(sizes) > MAX_RANKS or min(sizes) < 1 or sum(sizes) != len(self.descriptor)
        ):
            raise ProtocolError("Reserved.rank_descriptors do not split its descriptor")

    @property
    def dst_block_ids(self) -> list[int]:
        return unpack_ids(self.block_ids)

    @property
    def descriptors(self) -> list[bytes]:
        """Each decode rank's pool descriptor, rank 0 first (one for a single process)."""
        if not self.rank_descriptors:
            return [self.descriptor]
        out, at = [], 0
        for size in self.rank_descriptors:
            out.append(self.descriptor[at : at + size])
            at += size
        return out


@dataclass(frozen=True, slots=True)
class Migrated:
    """prefill -> decode: the KV is in the reserved blocks; here is the first token."""

    TYPE: ClassVar[MsgType] = MsgType.MIGRATED
    PEERS: ClassVar[tuple[str, ...]] = ("prefill",)  # protocol.peer_names
    request_id: str
    prefill: str  # the sender
    token_id: int  # the first sampled token
    logprobs: dict[str, Any] | None  # as in Tokens
    cached_tokens: int  # prompt tokens prefill's prefix cache served


@dataclass(frozen=True, slots=True)
class Release:
    """prefill -> decode: free a reservation; no KV is coming (finished, aborted, failed)."""

    TYPE: ClassVar[MsgType] = MsgType.RELEASE
    PEERS: ClassVar[tuple[str, ...]] = ("prefill",)  # protocol.peer_names
    request_id: str
    prefill: str  # the sender
