"""The api's OpenAPI document (/openapi.json, /docs): what each route takes and answers.

`/docs` (Swagger UI) and `/redoc` load their scripts and styles from this server
(`/docs/assets/`, fastapi-offline's copies of Swagger UI 5 and ReDoc, with FastAPI's
self-hosting recipe): from a CDN, they rendered blank on a host without internet access.

The generation routes read their body themselves (to answer OpenAI errors and validate
from bytes), so FastAPI cannot see their request models: `body_doc` and `install_schemas`
put them into the document. The answer models below describe the bodies
openai_responses.py and interactive.py build as plain dicts (tests/integration/
test_schemathesis.py checks real answers against them). Every error any route answers is
an OpenAI error body (`ErrorResponse`); FastAPI's 422 is never answered and is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.resources import files
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles

from lmd.api.openai_tools import ToolCall

FinishReason = Literal["stop", "length", "abort"]
# A chat reply that stopped by itself after calling tools (api/parsers/) ends in tool_calls.
ChatFinishReason = Literal["stop", "length", "tool_calls", "abort"]
ASSETS_URL = "/docs/assets"

# What each error status of the api means (the body is always an ErrorResponse).
ERRORS = {
    400: "The request is invalid; `param` names the field when one is to blame.",
    401: "Missing or wrong API key (only when the server runs with --api-keys).",
    404: "No such model (or route).",
    413: "The body is larger than max_request_bytes.",
    415: "The body is not declared as JSON (Content-Type must be application/json).",
    500: "The engine failed while serving the request.",
    503: "Starting, draining, a role is down, or overloaded: retry after Retry-After seconds.",
}
GENERATE_ERRORS = (400, 401, 404, 413, 415, 500, 503)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "starting", "draining", "stopping", "degraded"]
    reason: str | None = None  # absent when ok
    missing_roles: list[str] | None = None  # roles with no running worker; absent if none


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    quantization: str | None  # the weights': fp8, w4a16, or a checkpoint's (awq, gptq, ...)
    kv_cache_dtype: Literal["auto", "int8", "fp8"]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null when the reply is only tool calls
    refusal: None
    # when the request's tools were called; the shape a later request sends them back in
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the <think> text


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: ChatFinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in a call's first entry
    arguments: str  # the next piece of the arguments' JSON text


class ToolCallDelta(BaseModel):
    """A piece of a call: its first entry has `id`, `type` and `function.name`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # the first chunk's
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: ChatFinishReason | None


class ChatCompletionChunk(BaseModel):
    """A chat stream's event; with stream_options.include_usage, a last one with `usage`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class InteractiveAnswer(BaseModel):
    """LMDeploy's answer; streamed, one per line with the delta's text."""

    text: str
    tokens: int
    input_tokens: int
    history_tokens: int
    finish_reason: FinishReason | None
    cached_tokens: int


# Every 503 says when to come back (RFC 9110 10.2.3; seconds).
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` entries for these error statuses."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": ERRORS[status]}
        if status == 503:
            out[status]["headers"] = RETRY_AFTER
    return out


# in components/schemas beside the request bodies (the streams' itemSchema refer to them)
STREAMED: tuple[type[BaseModel], ...] = (ChatCompletionChunk, CompletionChunk)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def sse(chunk: type[BaseModel]) -> dict[str, Any]:
    """A stream (stream: true) of server-sent events: `chunk`s, an error body when the
    request fails after the 200 went out, then `[DONE]` (OpenAPI 3.2's itemSchema)."""
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
            },
        ]
    }
    event = {"type": "object", "properties": {"data": data, "event": {"type": "string"}}}
    return {"text/event-stream": {"itemSchema": {**event, "required": ["data"]}}}


def json_lines(item: type[BaseModel], media_type: str) -> dict[str, Any]:
    """A stream (stream: true) of one JSON object per line: `item`s, or an error body."""
    return {media_type: {"itemSchema": {"anyOf": [_ref(item), _ref(ErrorResponse)]}}}


def answers(
    ok: type[BaseModel], *error_statuses: int, stream: dict[str, Any] | None = None
) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses`: `ok` as the JSON 200 (and the `stream` content), then errors."""
    out: dict[int | str, dict[str, Any]] = {200: {"model": ok}}
    if stream is not None:
        out[200]["content"] = stream
    return {**out, **errors(*error_statuses)}


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """FastAPI `openapi_extra` naming `model` as the JSON request body."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_schemas(app: FastAPI, bodies: Sequence[type[BaseModel]], model: str) -> None:
    """/openapi.json with the request models `bodies` in it, the served `model` as the
    example of every `model` field and parameter, and no 422 (never answered)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema(
                [(m, "validation") for m in (*bodies, *STREAMED)],
                ref_template="#/components/schemas/{model}",
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(defs.get("$defs", {}))
            for body in components.values():
                if "model" in body.get("properties", {}):
                    body["properties"]["model"]["examples"] = [model]
            # Path parameters are plain strings and bodies are validated by the routes, so
            # FastAPI's request validation (422) never answers.
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
                    for parameter in operation.get("parameters", []):
                        if parameter["name"] == "model":
                            parameter["example"] = model
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def app_with_docs(title: str, version: str, response_class: type[Response]) -> FastAPI:
    """A FastAPI app whose /docs and /redoc pages need nothing but this server."""
    app = FastAPI(
        title=title,
        version=version,
        default_response_class=response_class,
        docs_url=None,
        redoc_url=None,
    )
    assets = files("fastapi_offline") / "static"  # swagger-ui-bundle.js, redoc.standalone.js
    app.mount(ASSETS_URL, StaticFiles(directory=str(assets)), name="docs-assets")
    openapi_url, favicon = app.openapi_url or "/openapi.json", f"{ASSETS_URL}/favicon.png"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{title} - Swagger UI",
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=favicon,
            swagger_ui_parameters={"validatorUrl": None},  # its badge is an online service
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{title} - ReDoc",
            redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=favicon,
            with_google_fonts=False,
        )

    return app
