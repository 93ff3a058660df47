"""Every message that crosses a process boundary, and nothing else.

How a message becomes frames is wire.py's (type byte, orjson header, raw frames; nothing
pickled). `decode` checks everything a peer could get wrong (type byte, header shape,
field names and types, frame count, then each message's own `check`) and raises
ProtocolError; receivers log, count and drop.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from lmd.names import WORKER_NAME
from lmd.wire import Codec, ProtocolError, pack_ids, unpack_ids

__all__ = ["ProtocolError", "pack_ids", "unpack_ids"]  # re-exported: part of the protocol


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
    # KV migration, prefill <-> decode (ARCHITECTURE §4)
    RESERVE = 30
    RESERVED = 31
    MIGRATED = 32
    RELEASE = 33


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
class Reconfigure:
    """New values of config keys that apply live (lmdctl reload): {key: value}."""

    TYPE: ClassVar[MsgType] = MsgType.RECONFIGURE
    values: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ClusterState:
    """The daemon's view of itself, pushed to every worker when it changes."""

    TYPE: ClassVar[MsgType] = MsgType.CLUSTER_STATE
    state: str  # DaemonState value
    missing_roles: list[str]  # roles with no running worker (why /health is 503)
    # Running workers by name, with each one's pid: a name whose pid changed is a new
    # process, and whatever the old one held (requests, KV reservations) is gone.
    workers: dict[str, int] = dataclasses.field(default_factory=dict)
    # Running workers being retired (lmdctl scale): route nothing new to them.
    draining: list[str] = dataclasses.field(default_factory=list)
    # A cluster's workers on other nodes: name -> their inbox's tcp:// endpoint.
    endpoints: dict[str, str] = dataclasses.field(default_factory=dict)
    # Engines' published load (routing.py): name -> {"queued_tokens", "free_blocks"}.
    load: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def check(self) -> None:
        for name, pid in self.workers.items():
            _check_name("ClusterState", "workers", name)
            if not isinstance(pid, int) or isinstance(pid, bool):
                raise ProtocolError("ClusterState.workers: a pid is not an integer")
        for name, endpoint in self.endpoints.items():
            if name not in self.workers or not str(endpoint).startswith("tcp://"):
                raise ProtocolError(f"ClusterState.endpoints: bad entry for {name[:40]!r}")


def _check_name(cls: str, field: str, value: str) -> None:
    if not WORKER_NAME.fullmatch(value):
        raise ProtocolError(f"{cls}.{field} {value[:40]!r} is not a worker name")


def _check_ids(cls: str, field: str, value: bytes) -> None:
    if not value or len(value) % 4:
        raise ProtocolError(f"{cls}.{field} must be a non-empty int32 array")


@dataclass(frozen=True, slots=True)
class Generate:
    """Run a tokenized request; its tokens go to the inbox of worker `reply_to`.

    Sent to a hybrid engine (`decode` empty), or to a prefill worker with the decode
    worker that continues the request after its KV migrated there.
    """

    TYPE: ClassVar[MsgType] = MsgType.GENERATE
    request_id: str
    reply_to: str  # a worker name, e.g. "tokenizer-0"
    sampling: dict[str, Any]  # SamplingParams fields
    prompt: bytes  # token ids, int32 little-endian
    decode: str = ""  # disaggregated: the decode worker's name

    def check(self) -> None:
        _check_ids("Generate", "prompt", self.prompt)
        _check_name("Generate", "reply_to", self.reply_to)
        if self.decode:
            _check_name("Generate", "decode", self.decode)

    @property
    def prompt_token_ids(self) -> list[int]:
        return unpack_ids(self.prompt)


@dataclass(frozen=True, slots=True)
class Abort:
    """Forget a request and free what it holds (client gone, or stopped early)."""

    TYPE: ClassVar[MsgType] = MsgType.ABORT
    request_id: str


@dataclass(frozen=True, slots=True)
class Tokens:
    """The tokens one engine step sampled, one entry per request, for one receiver."""

    TYPE: ClassVar[MsgType] = MsgType.TOKENS
    request_ids: list[str]
    finish_reasons: list[str | None]  # stop, length, abort on a request's last token
    logprobs: list[dict[str, Any] | None]  # {"logprob", "top": [[id, logprob], ...]}
    cached_tokens: list[int]  # prompt tokens the prefix cache served (no compute)
    token_ids: bytes  # int32 little-endian, one per request
    # int32 little-endian, one per request: the token's index among the request's output
    # tokens. In disaggregated mode token 0 comes from prefill and the rest from decode,
    # over different sockets: the tokenizer puts them back in order by it.
    positions: bytes

    def check(self) -> None:
        n = len(self.request_ids)
        lists = (self.finish_reasons, self.logprobs, self.cached_tokens)
        if any(len(x) != n for x in lists):
            raise ProtocolError(
                "Tokens: request_ids, finish_reasons, logprobs, cached_tokens differ in length"
            )
        if len(self.token_ids) != 4 * n:
            raise ProtocolError(f"Tokens: {n} requests but {len(self.token_ids) // 4} token ids")
        if len(self.positions) != 4 * n:
            raise ProtocolError(f"Tokens: {n} requests but {len(self.positions) // 4} positions")


@dataclass(frozen=True, slots=True)
class RequestError:
    """A request failed where it was; `code` is an OpenAI-style error type."""

    TYPE: ClassVar[MsgType] = MsgType.REQUEST_ERROR
    request_id: str
    code: str  # invalid_request_error, overloaded, internal_error
    message: str


@dataclass(frozen=True, slots=True)
class TextRequest:
    """An OpenAI request as the api hands it to the tokenizer (already validated).

    Exactly one of `messages` (chat), `prompt` (completion text) or `prompt_ids`
    (completion given as token ids; empty bytes when not) is set.

    `session_id` (>= 0) makes it a turn of an interactive session (/v1/chat/interactive,
    LMDeploy's): `prompt` is then a user turn for the chat template, not raw text. With
    `interactive_mode` the turn follows the session's history and its answer joins it;
    without, the session starts afresh and keeps nothing.
    """

    TYPE: ClassVar[MsgType] = MsgType.TEXT_REQUEST
    request_id: str
    reply_to: str  # the api worker's name
    messages: list[dict[str, Any]] | None
    prompt: str | None
    sampling: dict[str, Any]  # SamplingParams fields, passed on to the engine
    stop: list[str]  # stop strings, matched on text across token boundaries
    skip_special_tokens: bool
    prompt_ids: bytes  # int32 little-endian
    session_id: int | None = None  # an interactive session's id; None: no session
    interactive_mode: bool = False  # keep the session's history (only with session_id)

    def check(self) -> None:
        given = [self.messages is not None, self.prompt is not None, bool(self.prompt_ids)]
        if sum(given) != 1:
            raise ProtocolError("TextRequest needs exactly one of messages, prompt, prompt_ids")
        if self.session_id is not None and (self.session_id < 0 or self.prompt_ids):
            raise ProtocolError("TextRequest.session_id must be >= 0 and needs messages or prompt")
        if len(self.prompt_ids) % 4:
            raise ProtocolError("TextRequest.prompt_ids must be an int32 array")
        if not WORKER_NAME.fullmatch(self.reply_to):
            raise ProtocolError(f"TextRequest.reply_to {self.reply_to[:40]!r} is not a worker name")


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text of several requests since the last delta, for one api worker.

    Per request: the text to append (stop strings removed), the finish reason on its
    last delta (stop, length, abort), token counts so far (`cached_tokens`: prompt tokens
    the engine's prefix cache served; `history_tokens`: prompt tokens an interactive
    session brought from earlier turns, else 0), and, when logprobs were asked for, one
    entry per new token: {"token", "logprob", "top": [[token, logprob], ...]}.
    """

    TYPE: ClassVar[MsgType] = MsgType.TEXT_DELTA
    request_ids: list[str]
    texts: list[str]
    finish_reasons: list[str | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[list[dict[str, Any]] | None]
    cached_tokens: list[int]
    history_tokens: list[int]

    def check(self) -> None:
        n = len(self.request_ids)
        lists = (
            self.texts,
            self.finish_reasons,
            self.prompt_tokens,
            self.completion_tokens,
            self.logprobs,
            self.cached_tokens,
            self.history_tokens,
        )
        if any(len(x) != n for x in lists):
            raise ProtocolError("TextDelta: per-request lists differ in length")


SESSION_ACTIONS = ("cancel", "end")


@dataclass(frozen=True, slots=True)
class SessionControl:
    """An interactive session's control, api -> tokenizer (answered by nobody).

    `cancel` aborts the session's running request (it finishes with "abort" and its
    turn is not kept); `end` does that too and forgets the session.
    """

    TYPE: ClassVar[MsgType] = MsgType.SESSION_CONTROL
    session_id: int
    action: str  # one of SESSION_ACTIONS

    def check(self) -> None:
        if self.action not in SESSION_ACTIONS:
            raise ProtocolError(f"SessionControl.action {self.action[:20]!r} is not cancel or end")


@dataclass(frozen=True, slots=True)
class Reserve:
    """prefill -> decode: hold KV blocks for this prompt (step 1 of a migration).

    Decode answers Reserved once the blocks are allocated (it may queue the request
    until they free up), or RequestError when it cannot take the request at all.
    """

    TYPE: ClassVar[MsgType] = MsgType.RESERVE
    request_id: str
    prefill: str  # the sender; Reserved and errors go back to it
    reply_to: str  # where decode streams the tokens (the tokenizer)
    sampling: dict[str, Any]  # SamplingParams fields
    prompt: bytes  # token ids, int32 little-endian

    def check(self) -> None:
        _check_ids("Reserve", "prompt", self.prompt)
        _check_name("Reserve", "prefill", self.prefill)
        _check_name("Reserve", "reply_to", self.reply_to)

    @property
    def prompt_token_ids(self) -> list[int]:
        return unpack_ids(self.prompt)


@dataclass(frozen=True, slots=True)
class Reserved:
    """decode -> prefill: blocks allocated for a request (step 2 of a migration).

    `block_ids[i]` receives the prompt's i-th block. The first `num_cached_blocks` of
    them already hold that KV (decode's prefix cache): prefill does not copy those.
    `descriptor` opens decode's KV pool with the migration transport; prefill checks
    `block_nbytes` against its own pool and every id against the pool's size.
    """

    TYPE: ClassVar[MsgType] = MsgType.RESERVED
    request_id: str
    decode: str  # the sender
    transport: str  # host or cuda_ipc
    block_nbytes: int
    num_blocks: int  # blocks in decode's pool
    num_cached_blocks: int
    descriptor: bytes
    block_ids: bytes  # int32 little-endian

    def check(self) -> None:
        _check_name("Reserved", "decode", self.decode)
        _check_ids("Reserved", "block_ids", self.block_ids)
        if not self.descriptor:
            raise ProtocolError("Reserved.descriptor is empty")

    @property
    def dst_block_ids(self) -> list[int]:
        return unpack_ids(self.block_ids)


@dataclass(frozen=True, slots=True)
class Migrated:
    """prefill -> decode: the KV is in the reserved blocks; here is the first token."""

    TYPE: ClassVar[MsgType] = MsgType.MIGRATED
    request_id: str
    prefill: str  # the sender
    token_id: int  # the first sampled token
    logprobs: dict[str, Any] | None  # as in Tokens
    cached_tokens: int  # prompt tokens prefill's prefix cache served


@dataclass(frozen=True, slots=True)
class Release:
    """prefill -> decode: free a reservation; no KV is coming (finished, aborted, failed)."""

    TYPE: ClassVar[MsgType] = MsgType.RELEASE
    request_id: str
    prefill: str  # the sender


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
    Reserve,
    Reserved,
    Migrated,
    Release,
]


_CODEC = Codec(typing.get_args(Message))


def encode(msg: Message) -> list[bytes]:
    return _CODEC.encode(msg)


def decode(frames: list[bytes]) -> Message:
    """Parse a multipart message; raise ProtocolError saying what is wrong."""
    msg: Message = _CODEC.decode(frames)
    return msg
