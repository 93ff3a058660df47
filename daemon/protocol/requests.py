"""The data path: requests, tokens, text and errors between api, tokenizer and engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lmd.protocol.kinds import MsgType, check_chat_options, check_ids, check_name
from lmd.wire import ProtocolError, unpack_ids

# The most choices (OpenAI's `n`) one request may ask for: each is an engine request of
# its own, with its own KV beyond the prompt's shared blocks.
MAX_CHOICES = 16


@dataclass(frozen=True, slots=True)
class Generate:
    """Run a tokenized request; its tokens go to the inbox of worker `reply_to`.

    Sent to a hybrid engine (`decode` empty), or to a prefill worker with the decode
    worker that continues the request after its KV migrated there.
    """

    TYPE: ClassVar[MsgType] = MsgType.GENERATE
    PEERS: ClassVar[tuple[str, ...]] = ("reply_to", "decode")  # protocol.peer_names
    request_id: str
    reply_to: str  # a worker name, e.g. "tokenizer-0"
    sampling: dict[str, Any]  # SamplingParams fields
    prompt: bytes  # token ids, int32 little-endian
    decode: str = ""  # disaggregated: the decode worker's name
    sent_at: float = 0.0  # time.time() when sent (stage_times.py); 0: not stamped

    def check(self) -> None:
        check_ids("Generate", "prompt", self.prompt)
        check_name("Generate", "reply_to", self.reply_to)
        if self.decode:
            check_name("Generate", "decode", self.decode)

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
    sent_at: float = 0.0  # time.time() when sent (stage_times.py); 0: not stamped

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
    code: str  # invalid_request_error, overloaded, service_unavailable, internal_error
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

    `n` (1..MAX_CHOICES; 1 in a session): how many choices to sample from the one prompt
    (tokenizer/choices.py).
    """

    TYPE: ClassVar[MsgType] = MsgType.TEXT_REQUEST
    PEERS: ClassVar[tuple[str, ...]] = ("reply_to",)  # protocol.peer_names
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
    # chat only: the tools' definitions ({"type": "function", "function": {...}}) and extra
    # variables, both for the chat template
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    n: int = 1
    sent_at: float = 0.0  # time.time() when sent (stage_times.py); 0: not stamped

    def check(self) -> None:
        given = [self.messages is not None, self.prompt is not None, bool(self.prompt_ids)]
        if sum(given) != 1:
            raise ProtocolError("TextRequest needs exactly one of messages, prompt, prompt_ids")
        if self.session_id is not None and (self.session_id < 0 or self.prompt_ids):
            raise ProtocolError("TextRequest.session_id must be >= 0 and needs messages or prompt")
        if not 1 <= self.n <= (1 if self.session_id is not None else MAX_CHOICES):
            raise ProtocolError(f"TextRequest.n {self.n} is out of range")
        if len(self.prompt_ids) % 4:
            raise ProtocolError("TextRequest.prompt_ids must be an int32 array")
        check_name("TextRequest", "reply_to", self.reply_to)
        check_chat_options("TextRequest", self.messages, self.tools, self.chat_template_kwargs)


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text of several requests since the last delta, for one api worker.

    Per request: the text to append (stop strings removed), the finish reason on its
    last delta (stop, length, abort), token counts so far (`cached_tokens`: prompt tokens
    the engine's prefix cache served; `history_tokens`: prompt tokens an interactive
    session brought from earlier turns, else 0), and, when logprobs were asked for, one
    entry per new token: {"token", "logprob", "bytes", "top": [[token, logprob, bytes], ...]}
    (bytes: the token's raw UTF-8 bytes as a list of ints, see tokenizer/text/token_bytes.py);
    `indexes`: the choice each entry is of (OpenAI's `choices[].index`; 0 unless the
    request asked for n > 1). Each count is the choice's own; every choice has the same
    `prompt_tokens`.
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
    indexes: list[int]
    sent_at: float = 0.0  # time.time() when sent (stage_times.py); 0: not stamped

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
            self.indexes,
        )
        if any(len(x) != n for x in lists):
            raise ProtocolError("TextDelta: per-request lists differ in length")
        if self.indexes and not 0 <= min(self.indexes) <= max(self.indexes) < MAX_CHOICES:
            raise ProtocolError("TextDelta.indexes: a choice index is out of range")


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
class Tokenize:
    """Tokenize a prompt, or render a chat and tokenize it (/tokenize), api -> tokenizer;
    answered with Tokenized or RequestError. Exactly one of `prompt` and `messages`."""

    TYPE: ClassVar[MsgType] = MsgType.TOKENIZE
    PEERS: ClassVar[tuple[str, ...]] = ("reply_to",)  # protocol.peer_names
    request_id: str
    reply_to: str  # the api worker's name
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool  # the tokenizer's own (BOS, ...) around the text
    add_generation_prompt: bool  # chat: end where the model's reply begins
    return_token_strs: bool  # also each token's string (Tokenized.token_strs)
    tools: list[dict[str, Any]] | None = None  # chat: as TextRequest's
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("Tokenize needs exactly one of prompt, messages")
        check_name("Tokenize", "reply_to", self.reply_to)
        check_chat_options("Tokenize", self.messages, self.tools, self.chat_template_kwargs)


@dataclass(frozen=True, slots=True)
class Detokenize:
    """Token ids back to text (/detokenize), api -> tokenizer; answered with Tokenized."""

    TYPE: ClassVar[MsgType] = MsgType.DETOKENIZE
    PEERS: ClassVar[tuple[str, ...]] = ("reply_to",)  # protocol.peer_names
    request_id: str
    reply_to: str
    token_ids: bytes  # int32 little-endian

    def check(self) -> None:
        if len(self.token_ids) % 4:  # none is fine: ""
            raise ProtocolError("Detokenize.token_ids must be an int32 array")
        check_name("Detokenize", "reply_to", self.reply_to)


@dataclass(frozen=True, slots=True)
class Tokenized:
    """The answer to Tokenize (token ids; `token_strs` when asked) or Detokenize (`text`),
    tokenizer -> api. `max_model_len`: the session length, prompt and output together."""

    TYPE: ClassVar[MsgType] = MsgType.TOKENIZED
    request_id: str
    token_ids: bytes  # int32 little-endian; empty for a Detokenize
    text: str  # the decoded text; empty for a Tokenize
    token_strs: list[str] | None
    max_model_len: int

    def check(self) -> None:
        if len(self.token_ids) % 4:
            raise ProtocolError("Tokenized.token_ids must be an int32 array")
        if self.token_strs is not None and len(self.token_strs) != len(self.token_ids) // 4:
            raise ProtocolError("Tokenized: token_strs and token_ids differ in length")
