"""LMDeploy's /v1/chat/interactive: its request model and its response shape.

A turn of a session the server keeps (`session_id` >= 0, `interactive_mode`: true): the
server holds the conversation, so each request sends only the new turn, and the
engine's prefix cache serves the history's KV. Fields and defaults are LMDeploy's
GenerateRequest (0.6.5); `max_tokens` is taken as another name for
`request_output_len`.

  interactive_mode true    the turn follows the session's history; its answer joins it
  interactive_mode false   a one-off turn: the session starts afresh and keeps nothing
  cancel true              stop the session's running turn (it ends with "abort")
  prompt "" or [] with interactive_mode false and a session_id: end the session

Answers are `{"text", "tokens", "input_tokens", "history_tokens", "finish_reason",
"cached_tokens"}`: `tokens` generated so far, `input_tokens` the turn's new prompt
tokens, `history_tokens` those the session brought, `cached_tokens` the prompt tokens
the prefix cache served. Streamed, each delta is one such JSON object on its own line
(`\n`-separated, as LMDeploy does), with the delta's text.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from pydantic import Field, model_validator

from lmd import protocol
from lmd.api.deltas import Answer, Delta, Tally
from lmd.api.openai_fields import (
    MAX_COUNT,
    RepetitionPenalty,
    Seed,
    StopStrings,
    Temperature,
    not_supported,
)
from lmd.api.openai_schema import ApiError, ChatMessage, RequestBody

MEDIA_TYPE = "application/x-ndjson"  # JSON objects separated by newlines
NO_SESSION = -1  # LMDeploy's default session_id: a one-off turn


class InteractiveRequest(RequestBody):
    prompt: str | list[ChatMessage]  # one user turn, or messages to add to the chat
    session_id: Annotated[int, Field(ge=NO_SESSION, lt=2**63)] = NO_SESSION
    interactive_mode: bool = False
    stream: bool = False
    stop: StopStrings = Field(default_factory=list)
    request_output_len: Annotated[int, Field(ge=1, lt=MAX_COUNT)] | None = None
    max_tokens: Annotated[int, Field(ge=1, lt=MAX_COUNT)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] = 0.8
    top_k: Annotated[int, Field(ge=-1, lt=MAX_COUNT)] = 40  # 0 or -1 = off
    temperature: Temperature = 0.8
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    cancel: bool = False
    seed: Seed | None = None
    min_new_tokens: Annotated[int, Field(ge=0, lt=MAX_COUNT)] | None = None
    image_url: Annotated[Any, not_supported("this server serves text-only models")] = None
    adapter_name: Annotated[str, not_supported()] | None = None

    @model_validator(mode="after")
    def _session_needed(self) -> InteractiveRequest:
        if self.session_id == NO_SESSION and (self.interactive_mode or self.cancel):
            what = "cancel" if self.cancel else "interactive_mode"
            raise ValueError(f"{what} needs a session_id >= 0 (the session to act on)")
        if not self.prompt and not self.cancel and self.control is None:
            raise ValueError(
                "prompt must not be empty (an empty prompt with interactive_mode false "
                "and a session_id ends that session)"
            )
        return self

    @property
    def control(self) -> str | None:
        """The SessionControl action this request asks for instead of a turn, if any."""
        if self.cancel:
            return "cancel"
        if not self.prompt and not self.interactive_mode and self.session_id != NO_SESSION:
            return "end"
        return None

    @property
    def num_choices(self) -> int:
        return 1  # a turn has one answer, which joins the session's history

    def sampling(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "min_new_tokens": self.min_new_tokens or 0,
            "stop_token_ids": [],
            "ignore_eos": self.ignore_eos,
            "logprobs": None,
        }
        max_tokens = self.request_output_len or self.max_tokens
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        return out

    def text_request(
        self, request_id: str, reply_to: str, sent_at: float = 0.0
    ) -> protocol.TextRequest:
        """The turn for the tokenizer; a one-off without session is a one-message chat."""
        messages, prompt = None, None
        if isinstance(self.prompt, list):
            messages = [m.to_dict() for m in self.prompt]
        elif self.session_id == NO_SESSION:
            messages = [{"role": "user", "content": self.prompt}]
        else:
            prompt = self.prompt
        in_session = self.session_id != NO_SESSION
        return protocol.TextRequest(
            request_id=request_id,
            reply_to=reply_to,
            sent_at=sent_at,
            messages=messages,
            prompt=prompt,
            sampling=self.sampling(),
            stop=self.stop,
            skip_special_tokens=self.skip_special_tokens,
            prompt_ids=b"",
            session_id=self.session_id if in_session else None,
            interactive_mode=self.interactive_mode,
        )


def prefix_caching_off() -> ApiError:
    return ApiError(
        400,
        "/v1/chat/interactive needs prefix caching, which this server runs without; "
        "restart lmdd with --enable-prefix-caching",
        code="prefix_caching_off",
    )


class InteractiveFormat:
    """Response bodies and stream lines of /v1/chat/interactive (LMDeploy's shape)."""

    @staticmethod
    def body(
        text: str,
        finish_reason: str | None,
        *,
        completion_tokens: int = 0,
        prompt_tokens: int = 0,
        history_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> dict[str, Any]:
        return {
            "text": text,
            "tokens": completion_tokens,
            "input_tokens": prompt_tokens - history_tokens,
            "history_tokens": history_tokens,
            "finish_reason": finish_reason,
            "cached_tokens": cached_tokens,
        }

    def response(self, answers: list[Answer]) -> dict[str, Any]:
        answer = answers[0]  # a turn has one
        return self.body(
            "".join(answer.text),
            answer.finish_reason,
            completion_tokens=answer.completion_tokens,
            prompt_tokens=answer.prompt_tokens,
            history_tokens=answer.history_tokens,
            cached_tokens=answer.cached_tokens,
        )

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        if not delta.text and delta.finish_reason is None:
            return None
        return self.body(
            delta.text,
            delta.finish_reason,
            completion_tokens=delta.completion_tokens,
            prompt_tokens=delta.prompt_tokens,
            history_tokens=delta.history_tokens,
            cached_tokens=delta.cached_tokens,
        )

    @classmethod
    def control_done(cls) -> dict[str, Any]:
        """The answer to cancel and end (LMDeploy's): nothing generated."""
        return cls.body("", "stop")


def json_line(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj) + b"\n"


class LineFraming:
    """An interactive stream: one JSON object per line, an error as its error body."""

    media_type = MEDIA_TYPE

    def __init__(self, fmt: InteractiveFormat) -> None:
        self.fmt = fmt

    def head(self) -> list[bytes]:
        return []

    def frame(self, delta: Delta) -> bytes | None:
        chunk = self.fmt.chunk(delta)
        return None if chunk is None else json_line(chunk)

    def error(self, err: ApiError) -> bytes:
        return json_line(err.body)

    def tail(self, tally: Tally, ok: bool) -> list[bytes]:
        return []
