"""Message type bytes, the size cap of each kind, and the field checks several messages share."""

from __future__ import annotations

import enum
from typing import Any

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
    TOKENIZE = 27  # /tokenize and /detokenize, api <-> tokenizer
    DETOKENIZE = 28
    TOKENIZED = 29
    # KV migration, prefill <-> decode (docs/architecture.md §1, steps 3-4)
    RESERVE = 30
    RESERVED = 31
    MIGRATED = 32
    RELEASE = 33


KiB, MiB = 1 << 10, 1 << 20

# The most bytes a message of each kind may take on the wire, all its frames together.
# `decode` drops a bigger one before parsing its header, and `Channel.try_send` refuses
# to send one (the sender fails the request instead of the receiver dropping it). Each
# cap is far above the largest message the daemon makes; the largest of them is also
# every socket's ZMQ_MAXMSGSIZE (per frame: a peer that sends more is disconnected).
MAX_BYTES: dict[int, int] = {  # by MsgType
    MsgType.READY: 1 * MiB,  # a few role facts
    MsgType.HEARTBEAT: 4 * MiB,  # counters and the stage histograms (~10 KiB)
    MsgType.DRAIN: 4 * KiB,  # no fields
    MsgType.RESUME: 4 * KiB,
    MsgType.STOP: 4 * KiB,
    MsgType.CLUSTER_STATE: 16 * MiB,  # ~150 bytes per worker of the cluster
    MsgType.RECONFIGURE: 1 * MiB,  # live keys (api_keys is the longest)
    # 4 bytes per prompt token: 4M tokens fit (a 1M-token prompt is 4 MiB)
    MsgType.GENERATE: 16 * MiB,
    MsgType.ABORT: 64 * KiB,  # a request id
    # one entry per request of a step (max_batch_size, 20 top logprobs: ~0.6 KiB each)
    MsgType.TOKENS: 8 * MiB,
    MsgType.REQUEST_ERROR: 1 * MiB,
    # an HTTP body re-encoded (token ids grow to 4 bytes each: at most 2x the body); room
    # for the api's max_request_bytes up to 32 MiB
    MsgType.TEXT_REQUEST: 64 * MiB,
    # at most DeltaOutbox.MAX_ENTRIES (512) entries of a token's text and logprobs
    MsgType.TEXT_DELTA: 8 * MiB,
    MsgType.SESSION_CONTROL: 4 * KiB,
    # as TEXT_REQUEST: an HTTP body re-encoded
    MsgType.TOKENIZE: 64 * MiB,
    MsgType.DETOKENIZE: 64 * MiB,
    # the token ids of a prompt that fits a TextRequest, their strings (~10 bytes each)
    MsgType.TOKENIZED: 64 * MiB,
    MsgType.RESERVE: 16 * MiB,  # a prompt, as Generate
    MsgType.RESERVED: 16 * MiB,  # the transport's descriptor and a block id per prompt block
    MsgType.MIGRATED: 1 * MiB,  # one token and its logprobs
    MsgType.RELEASE: 64 * KiB,
}
MAX_FRAME_BYTES = max(MAX_BYTES.values())


def check_name(cls: str, field: str, value: str) -> None:
    if not WORKER_NAME.fullmatch(value):
        raise ProtocolError(f"{cls}.{field} {value[:40]!r} is not a worker name")


def check_chat_options(
    cls: str,
    messages: list[dict[str, Any]] | None,
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
) -> None:
    """A chat's tools (objects) and template variables go only with messages."""
    if messages is None and (tools is not None or template_kwargs is not None):
        raise ProtocolError(f"{cls}: tools and chat_template_kwargs need messages")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ProtocolError(f"{cls}.tools: an element has the wrong type")


def check_ids(cls: str, field: str, value: bytes) -> None:
    if not value or len(value) % 4:
        raise ProtocolError(f"{cls}.{field} must be a non-empty int32 array")
