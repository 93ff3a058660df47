"""The api process: the OpenAI HTTP front on --host/--port (FastAPI on uvicorn + uvloop).

Life cycle of a generation request in the api (POST /v1/chat/completions, /v1/completions,
/v1/chat/interactive):
  1. RequestGuard checks the API key (/v1/* only), the body size (413) and that the body
     is JSON by its Content-Type (415) before any parsing; the body is validated into a
     request model (400 naming the field), the model name checked (404), and the
     daemon's state (503 + Retry-After while starting, draining or missing a role: the
     one readiness rule, `unavailable`, which /v1/models answers by too).
  2. Admitted: an OpenRequest is registered under a fresh id (chatcmpl-... / cmpl-...)
     and a TextRequest goes to the tokenizer, which answers on our inbox.
  3. `handle` routes each TextDelta entry or RequestError to its request's Events and keeps
     the counts and timings (first token, last token).
  4. Non-streaming: the deltas are added up into one body. Streaming: the first event is
     awaited before the 200 goes out (so an over-long prompt is still a 400), then each
     delta becomes an SSE chunk, then the usage chunk if asked for, then [DONE]
     (/v1/chat/interactive: one JSON object per line, LMDeploy's framing).
  5. Closed however it ends (last token, error, client gone): the request leaves the
     table; if the tokenizer still holds it (client gone first), an Abort goes down.
If the tokenizer stops, every open request fails with 503 at once instead of hanging; so
does each one still open when the daemon stops (the drain timed out), instead of dropping.
An interactive `cancel` or session end is a SessionControl to the tokenizer, answered at
once (the session's history lives in the tokenizer, see tokenizer/sessions.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import PlainTextResponse, Response

from lmd import __version__, protocol
from lmd.api import readiness
from lmd.api.deltas import Delta, Tally
from lmd.api.docs import (
    GENERATE_ERRORS,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    Health,
    InteractiveAnswer,
    ModelCard,
    ModelList,
    answers,
    app_with_docs,
    body_doc,
    errors,
    install_schemas,
    json_lines,
    sse,
)
from lmd.api.formats import Body, Format, answer_format
from lmd.api.http import (
    EventStream,
    GuardLimits,
    RequestGuard,
    connection_limits,
    disconnected,
    error_response,
    install_error_handlers,
)
from lmd.api.interactive import (
    MEDIA_TYPE,
    InteractiveFormat,
    InteractiveRequest,
    prefix_caching_off,
)
from lmd.api.metrics import CLIENT_GONE, CONTENT_TYPE, ApiMetrics
from lmd.api.models import model_card
from lmd.api.openai_responses import Framing
from lmd.api.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest, unknown_model
from lmd.api.parsers.choice import ReplyChoice
from lmd.api.request import OpenRequest, add_up, first_events, writes
from lmd.api.tokenize import BODIES, TokenizerCalls, add_tokenize_routes
from lmd.api.tokenizers import TokenizerChoice
from lmd.config import ServeConfig
from lmd.http_server import BindError, EmbeddedServer, JSONResponse, bind_tcp
from lmd.paths import control_socket_path, metrics_dir
from lmd.protocol import Role
from lmd.roles import WorkerSpec
from lmd.worker import Worker, WorkerStartError

GENERATE_ENDPOINTS = ("chat_completions", "completions", "chat_interactive")
_BODY_MODELS: dict[str, type[Body]] = {
    "chat_completions": ChatCompletionRequest,
    "completions": CompletionRequest,
    "chat_interactive": InteractiveRequest,
}
_ID_PREFIXES = {"chat_completions": "chatcmpl", "completions": "cmpl", "chat_interactive": "chat"}


class ApiWorker(Worker):
    role = Role.API

    def __init__(self, spec: WorkerSpec, config: ServeConfig) -> None:
        self._open: dict[str, OpenRequest] = {}  # before Worker sets missing_roles
        self._missing_roles: list[str] = []
        super().__init__(spec, config)
        shared = metrics_dir(config.runtime_dir)  # every api process's series, added up
        self.metrics = ApiMetrics(shared, control_socket_path(config.runtime_dir))
        self.limits = GuardLimits(config.api_keys, config.max_request_bytes)
        self.replies = ReplyChoice(config)  # how chat replies are read: tools, reasoning
        self.calls = TokenizerCalls()  # /tokenize and /detokenize: awaiting the tokenizer
        self.tokenizers = TokenizerChoice(config)

    async def start(self) -> None:
        try:
            shared = self.config.api_workers > 1  # the kernel spreads connections over us
            sock = bind_tcp(self.config.host, self.config.port, reuse_port=shared)
        except BindError as exc:
            raise WorkerStartError(str(exc)) from None
        # Read once (its quantization from config.json): no served key it shows is live.
        self.model_card = model_card(self.config, created=int(time.time()))
        limits = connection_limits(self.config)
        self.server = EmbeddedServer(self.build_app(), sock, self.config.log_level, limits)
        await self.server.start()
        self.watch(self.server.task, "the HTTP server")

    async def stop(self) -> None:
        # What is still open (the drain timed out) gets a 503 now, whole or as its stream's
        # end, not a connection dropped by the supervisor's kill 5 s after Stop; closing it
        # sends the Abort that lets the engines free it (an api scaled down).
        self.end_open(self._open.values(), "the server is stopping; retry", held=True)
        await self.server.stop()

    def on_reconfigure(self, keys: set[str]) -> None:
        self.limits.set(self.config.api_keys, self.config.max_request_bytes)

    def info(self) -> dict[str, Any]:
        return {"listen": f"http://{self.config.host}:{self.config.port}"}

    def inflight(self) -> int:
        return len(self._open)

    @property
    def missing_roles(self) -> list[str]:
        return self._missing_roles

    @missing_roles.setter
    def missing_roles(self, roles: list[str]) -> None:
        self._missing_roles = roles
        if Role.TOKENIZER in roles:  # it died: what it held is lost
            self.end_open(self._open.values(), "the tokenizer stopped; retry")

    @staticmethod
    def end_open(requests: Iterable[OpenRequest], reason: str, held: bool = False) -> None:
        """Answer each of `requests` not ended with a 503 (`reason`); `held`: its tokenizer
        still holds it, so _close sends it an Abort."""
        error = protocol.RequestError("", "service_unavailable", reason)
        for request in requests:
            if not request.ended:
                request.ended = not held
                request.events.put(error)

    def tokenizer_for(self, session_id: int | None = None) -> str:
        """The tokenizer for a new request (tokenizers.py: in turn; a session's: its own)."""
        return self.tokenizers.pick(session_id)

    def on_cluster_state(self) -> None:
        """A tokenizer that left (in a cluster: not the one of a node-wide failure)
        took the requests it held."""
        self.tokenizers.update(self.workers)
        self.calls.fail_lost(self.workers, self.missing_roles)
        held = (r for r in self._open.values() if r.tokenizer not in self.workers)
        self.end_open(held, "the tokenizer stopped; retry")

    def health(self) -> tuple[int, dict[str, Any]]:
        return readiness.health(self.draining, self.cluster_state, self.missing_roles)

    def unavailable(self) -> ApiError | None:
        return readiness.unavailable(self.health())

    # Inbox: the tokenizer's answers ---------------------------------------------------

    async def handle(self, msg: protocol.Message) -> bool:
        if self.calls.answer(msg):  # to /tokenize or /detokenize
            return True
        if isinstance(msg, protocol.TextDelta):
            self.stages.since("to_api", msg.sent_at)
            now = time.perf_counter()
            for request_id, delta in Delta.split(msg):
                request = self._open.get(request_id)
                if request is None or request.ended:
                    continue  # closed already (client gone, aborted): late tokens
                if request.first_token_at is None and (delta.text or delta.completion_tokens):
                    request.first_token_at = now
                    self.metrics.first_token(now - request.started)
                if request.tally.add(delta):  # its last choice finished
                    request.ended, request.finished_at = True, now
                request.events.put(delta)
            return True
        if isinstance(msg, protocol.RequestError):
            request = self._open.get(msg.request_id)
            if request is not None and not request.ended:
                request.ended = True
                request.events.put(msg)
            return True
        return False

    # HTTP --------------------------------------------------------------------------------

    def build_app(self) -> FastAPI:
        app = app_with_docs("lmd", __version__, JSONResponse)

        @app.get("/health", responses={200: {"model": Health}, 503: {"model": Health}})
        async def health() -> JSONResponse:
            status, body = self.health()
            return JSONResponse(body, status_code=status)

        @app.get("/v1/models", responses={200: {"model": ModelList}, **errors(401, 503)})
        async def models() -> JSONResponse:
            """The served model, once the daemon can answer a completion (else 503)."""
            if (err := self.unavailable()) is not None:
                return error_response(err)
            return JSONResponse({"object": "list", "data": [self.model_card]})

        @app.get("/v1/models/{model:path}", responses=answers(ModelCard, 401, 404, 503))
        async def model(model: str) -> JSONResponse:
            if model != self.config.served_model_name:
                return error_response(unknown_model(model, self.config.served_model_name))
            if (err := self.unavailable()) is not None:
                return error_response(err)
            return JSONResponse(self.model_card)

        @app.post(
            "/v1/chat/completions",
            openapi_extra=body_doc(ChatCompletionRequest),
            responses=answers(ChatCompletion, *GENERATE_ERRORS, stream=sse(ChatCompletionChunk)),
        )
        async def chat_completions(request: Request) -> Response:
            return await self.generate(request, "chat_completions")

        @app.post(
            "/v1/completions",
            openapi_extra=body_doc(CompletionRequest),
            responses=answers(Completion, *GENERATE_ERRORS, stream=sse(CompletionChunk)),
        )
        async def completions(request: Request) -> Response:
            return await self.generate(request, "completions")

        @app.post(
            "/v1/chat/interactive",
            openapi_extra=body_doc(InteractiveRequest),
            responses=answers(
                InteractiveAnswer,
                *GENERATE_ERRORS,
                stream=json_lines(InteractiveAnswer, MEDIA_TYPE),
            ),
        )
        async def chat_interactive(request: Request) -> Response:
            """LMDeploy's interactive chat: the server keeps each session's history."""
            return await self.generate(request, "chat_interactive")

        @app.get("/metrics", response_class=PlainTextResponse)
        async def metrics() -> Response:
            return Response(await self.metrics.scrape(), media_type=CONTENT_TYPE)

        add_tokenize_routes(app, self)
        install_error_handlers(app)
        install_schemas(
            app,
            [ChatCompletionRequest, CompletionRequest, InteractiveRequest, *BODIES],
            self.config.served_model_name,
        )
        app.add_middleware(RequestGuard, limits=self.limits, on_reject=self._count_rejected)
        return app

    def _count_rejected(self, path: str, status: int) -> None:
        endpoint = path.removeprefix("/v1/").replace("/", "_")
        if endpoint in GENERATE_ENDPOINTS:
            self.metrics.count(endpoint, status)

    async def generate(self, http: Request, endpoint: str) -> Response:
        """Validate, admit, and answer one generation request (streamed or not)."""
        began = time.perf_counter()
        request_id = f"{_ID_PREFIXES[endpoint]}-{uuid.uuid4().hex}"
        try:
            body, tokenizer = await self._admit(http, endpoint, request_id)
        except ApiError as err:
            self.metrics.count(endpoint, err.status)
            return error_response(err)
        if body is None:  # an interactive cancel or end: the tokenizer does it
            self.metrics.count(endpoint, 200)
            return JSONResponse(InteractiveFormat.control_done())
        self.stages.observe("api", time.perf_counter() - began)
        tally = Tally(body.num_choices)
        request = self._open[request_id] = OpenRequest(request_id, endpoint, tokenizer, tally=tally)
        self.metrics.opened()
        client_gone = asyncio.ensure_future(disconnected(http))
        handed_over = False  # a stream watches client_gone from then on
        try:
            fmt, framing = await answer_format(body, request_id, self.replies)
            if body.stream:
                response = await self._start_stream(request, framing, client_gone)
                handed_over = isinstance(response, EventStream)
                return response
            return await self._answer(request, fmt, client_gone)
        except BaseException:
            self._close(request, 500)  # a no-op when already closed
            raise
        finally:
            if not handed_over:
                client_gone.cancel()

    async def _admit(
        self, http: Request, endpoint: str, request_id: str
    ) -> tuple[Body | None, str]:
        """Parse and check a request, and hand it to a tokenizer; raise ApiError.

        (None, tokenizer): the request was an interactive cancel or end, passed on.
        """
        try:
            body = _BODY_MODELS[endpoint].model_validate_json(await http.body())
        except ValidationError as exc:
            raise ApiError.from_validation(exc) from None
        if isinstance(body, InteractiveRequest):  # LMDeploy's: no model field
            if not self.config.enable_prefix_caching:
                raise prefix_caching_off()
        elif body.model != self.config.served_model_name:
            raise unknown_model(body.model, self.config.served_model_name)
        if (err := self.unavailable()) is not None:
            raise err
        session = body.session_id if isinstance(body, InteractiveRequest) else None
        tokenizer = self.tokenizer_for(session if session is not None and session >= 0 else None)
        if not isinstance(body, InteractiveRequest):
            await body.check()  # a constraint xgrammar cannot compile: 400
        msg: protocol.Message = body.text_request(request_id, self.spec.name, time.time())
        control = body.control if isinstance(body, InteractiveRequest) else None
        if isinstance(body, InteractiveRequest) and control is not None:
            msg = protocol.SessionControl(body.session_id, control)
        if not self.push(tokenizer, msg):
            reason = "the tokenizer is not keeping up; retry later"
            raise ApiError(503, reason, type="overloaded", retry_after_s=1)
        return (None if control is not None else body), tokenizer

    async def _answer(
        self, request: OpenRequest, fmt: Format, client_gone: asyncio.Future[None]
    ) -> Response:
        answers = await add_up(request, client_gone)
        if answers is None:
            self._close(request, CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        if isinstance(answers, ApiError):
            self._close(request, answers.status)
            return error_response(answers)
        self._close(request, 200)
        return JSONResponse(fmt.response(answers))

    async def _start_stream(
        self, request: OpenRequest, framing: Framing, client_gone: asyncio.Future[None]
    ) -> Response:
        events = await first_events(request, client_gone)
        if not events:
            self._close(request, CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        if isinstance(events[0], protocol.RequestError):
            err = ApiError.from_request_error(events[0])
            self._close(request, err.status)
            return error_response(err)
        answered: int | None = None  # the HTTP status, once the stream went out to its end

        def sent(status: int) -> None:
            nonlocal answered
            answered = status

        def on_close() -> None:
            self._close(request, CLIENT_GONE if answered is None else answered)

        return EventStream(
            writes(request, framing, events, sent, self.stages),
            on_close,
            client_gone,
            framing.media_type,
        )

    def _close(self, request: OpenRequest, status: int) -> None:
        """Forget a request; tell the tokenizer if it still holds it. Idempotent."""
        if self._open.pop(request.id, None) is None:
            return
        self.metrics.closed()
        if not request.ended:
            request.ended = True
            self.push(request.tokenizer, protocol.Abort(request.id))
        self.metrics.count(request.endpoint, status)
        tally = request.tally
        self.metrics.tokens(tally.prompt_tokens, tally.completion_tokens, sum(tally.cached))
        if request.finished_at is not None and status == 200:
            first = request.first_token_at
            self.metrics.finished(
                e2e_s=request.finished_at - request.started,
                first_token_s=None if first is None else first - request.started,
                num_tokens=max(tally.completion),  # choices decode side by side
            )
