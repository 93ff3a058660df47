"""/tokenize and /detokenize (vLLM's shapes): the served model's tokenizer and chat
template, without generating.

  POST /tokenize   {model?, prompt, add_special_tokens? (true), return_token_strs?}
               or  {model?, messages, add_generation_prompt? (true), add_special_tokens?
                    (false), tools?, chat_template_kwargs?, return_token_strs?}
                   -> {count, max_model_len, tokens[, token_strs]}
  POST /detokenize {model?, tokens} -> {prompt}
A chat is rendered exactly as /v1/chat/completions renders it (`max_model_len` is the
session length, prompt and output together).

Life cycle of a call: the body is validated (400 naming the field), the model checked
when given (404) and the daemon's readiness (503); a Tokenize or Detokenize goes to the
tokenizer under a fresh id and the route awaits its answer (TokenizerCalls): Tokenized,
or RequestError (a 400 for a chat the template refuses, a token id outside the
vocabulary). A tokenizer that stops fails the call with 503 at once; one that never
answers, after CALL_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Annotated, Protocol

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, ValidationError, model_validator
from starlette.responses import Response

from lmd import protocol
from lmd.api.docs import answers, body_doc
from lmd.api.openai_fields import TokenId
from lmd.api.openai_schema import ApiError, ChatMessage, RequestBody, unknown_model
from lmd.api.openai_tools import TemplateKwargs, Tools
from lmd.config import ServeConfig
from lmd.http_server import JSONResponse
from lmd.protocol import Role
from lmd.roles import WorkerSpec

CALL_TIMEOUT_S = 60.0
ERRORS = (400, 401, 404, 413, 415, 500, 503)


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for a chat
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: Tools | None = None
    chat_template_kwargs: TemplateKwargs | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages is None and (
            self.tools is not None or self.chat_template_kwargs is not None
        ):
            raise ValueError("tools and chat_template_kwargs go with messages")
        return self

    def message(self, request_id: str, reply_to: str) -> protocol.Tokenize:
        messages = None if self.messages is None else [m.to_dict() for m in self.messages]
        special = self.add_special_tokens
        return protocol.Tokenize(
            request_id,
            reply_to,
            self.prompt,
            messages,
            add_special_tokens=messages is None if special is None else special,
            add_generation_prompt=self.add_generation_prompt,
            return_token_strs=self.return_token_strs,
            tools=[t.for_template() for t in self.tools] if self.tools else None,
            chat_template_kwargs=self.chat_template_kwargs,
        )


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]

    def message(self, request_id: str, reply_to: str) -> protocol.Detokenize:
        return protocol.Detokenize(request_id, reply_to, protocol.pack_ids(self.tokens))


BODIES = (TokenizeRequest, DetokenizeRequest)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerCalls:
    """Calls waiting for the tokenizer's answer, by request id."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[str, asyncio.Future[protocol.Message]]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    async def ask(
        self,
        tokenizer: str,
        msg: protocol.Tokenize | protocol.Detokenize,
        push: Callable[[str, protocol.Message], bool],
    ) -> protocol.Tokenized:
        """Send `msg` to `tokenizer` and return its answer; raise ApiError."""
        future: asyncio.Future[protocol.Message] = asyncio.get_running_loop().create_future()
        self._waiting[msg.request_id] = (tokenizer, future)
        try:
            if not push(tokenizer, msg):
                reason = "the tokenizer is not keeping up; retry later"
                raise ApiError(503, reason, type="overloaded", retry_after_s=1)
            try:
                answer = await asyncio.wait_for(future, CALL_TIMEOUT_S)
            except TimeoutError:
                reason = f"the tokenizer did not answer within {CALL_TIMEOUT_S:.0f} s; retry"
                raise ApiError(503, reason, type="service_unavailable", retry_after_s=1) from None
        finally:
            del self._waiting[msg.request_id]
        if isinstance(answer, protocol.RequestError):
            raise ApiError.from_request_error(answer)
        assert isinstance(answer, protocol.Tokenized)
        return answer

    def answer(self, msg: protocol.Message) -> bool:
        """Take the tokenizer's answer to a call; False: not one (a RequestError of a
        generation request). A late Tokenized (its call timed out) is taken and dropped."""
        if not isinstance(msg, protocol.Tokenized | protocol.RequestError):
            return False
        waiting = self._waiting.get(msg.request_id)
        if waiting is not None and not waiting[1].done():
            waiting[1].set_result(msg)
        return waiting is not None or isinstance(msg, protocol.Tokenized)

    def fail_lost(self, workers: dict[str, int], missing_roles: list[str]) -> None:
        """Fail the calls whose tokenizer stopped (ClusterState): its answer cannot come."""
        lost = protocol.RequestError("", "service_unavailable", "the tokenizer stopped; retry")
        for tokenizer, future in self._waiting.values():
            gone = Role.TOKENIZER in missing_roles or (workers and tokenizer not in workers)
            if gone and not future.done():
                future.set_result(lost)


class TokenizeHost(Protocol):
    """What the routes need of the api worker."""

    calls: TokenizerCalls
    config: ServeConfig
    spec: WorkerSpec

    def tokenizer_for(self, session_id: int | None = None) -> str: ...

    def unavailable(self) -> ApiError | None: ...

    def push(self, worker_name: str, msg: protocol.Message) -> bool: ...


def add_tokenize_routes(app: FastAPI, host: TokenizeHost) -> None:
    async def call(
        http: Request, model: type[TokenizeRequest | DetokenizeRequest]
    ) -> protocol.Tokenized:
        """The tokenizer's answer to the body's call; raise ApiError, which the api's
        error handler (http.install_error_handlers) answers."""
        try:
            body = model.model_validate_json(await http.body())
        except ValidationError as exc:
            raise ApiError.from_validation(exc) from None
        served = host.config.served_model_name
        if body.model is not None and body.model != served:
            raise unknown_model(body.model, served)
        if (err := host.unavailable()) is not None:
            raise err
        msg = body.message(f"tok-{uuid.uuid4().hex}", host.spec.name)
        return await host.calls.ask(host.tokenizer_for(), msg, host.push)

    @app.post(
        "/tokenize",
        openapi_extra=body_doc(TokenizeRequest),
        responses=answers(TokenizeResponse, *ERRORS),
    )
    async def tokenize(http: Request) -> Response:
        """The prompt's token ids, or a chat's as the chat template renders it (vLLM's)."""
        answer = await call(http, TokenizeRequest)
        ids = protocol.unpack_ids(answer.token_ids)
        out = {"count": len(ids), "max_model_len": answer.max_model_len, "tokens": ids}
        if answer.token_strs is not None:
            out["token_strs"] = answer.token_strs
        return JSONResponse(out)

    @app.post(
        "/detokenize",
        openapi_extra=body_doc(DetokenizeRequest),
        responses=answers(DetokenizeResponse, *ERRORS),
    )
    async def detokenize(http: Request) -> Response:
        """Token ids back to text (vLLM's)."""
        answer = await call(http, DetokenizeRequest)
        return JSONResponse({"prompt": answer.text})
