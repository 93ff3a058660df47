"""OpenAI requests as the api accepts them, and the errors it answers with.

Requests are pydantic models validated straight from the body bytes in strict mode (a
string where a number belongs is a 400, never coerced). Fields OpenAI defines that would
change the answer and that lmd cannot honour (echo, suffix, functions, ...) are a 400
naming them. Top-level fields we do not know at all are ignored, as OpenAI does (SDKs
send some, e.g. `user`), and their names logged at debug level. `temperature` is OpenAI's
0 to 2 (LMDeploy's range too). Each request maps to the tokenizer's TextRequest
(`text_request`); tools and chat_template_kwargs go with it to the chat template, the
fields that constrain the output to `sampling["guided"]` (guided.py, whose `checks` are
compiled before the request is admitted); responses are built in openai_responses.py.
"""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from lmd import protocol
from lmd.api.guided import (
    ANY_OBJECT,
    Guided,
    GuidedFields,
    constraint_in,
    first_problem,
    schema_text,
    tool_calls_schema,
)
from lmd.api.openai_fields import (
    MAX_COUNT,
    BadWords,
    Content,
    LogitBias,
    NumChoices,
    Penalty,
    Prompt,
    RepetitionPenalty,
    Seed,
    StopStrings,
    StrictModel,
    Temperature,
    TokenId,
    not_supported,
)
from lmd.api.openai_tools import NamedToolChoice, TemplateKwargs, ToolCall, ToolChoice, Tools
from lmd.engine.sequence import MAX_LOGPROBS

log = logging.getLogger(__name__)

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API allows 0..5

# RequestError.code -> HTTP status; anything unknown is a 500.
_STATUS_OF_CODE = {
    "invalid_request_error": 400,
    "overloaded": 503,
    "service_unavailable": 503,
    "internal_error": 500,
}


class ApiError(Exception):
    """An error answered as an OpenAI error body with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # the OpenAI field name
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    @classmethod
    def from_request_error(cls, err: protocol.RequestError) -> ApiError:
        status = _STATUS_OF_CODE.get(err.code, 500)
        return cls(status, err.message, type=err.code, retry_after_s=1 if status == 503 else None)

    @classmethod
    def from_validation(cls, exc: ValidationError) -> ApiError:
        """The first problem pydantic found, with the field it is about as `param`.

        A field of several types (a union) fails once per type: of its failures, the one
        deepest in the value is the one about the type the client meant (a list of
        messages with a bad role, not "should be a string").
        """
        problems = exc.errors(include_url=False)
        field = problems[0]["loc"][:1]
        first = max((p for p in problems if p["loc"][:1] == field), key=lambda p: len(p["loc"]))
        if first["type"] == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            return cls(400, f"the request body is not valid JSON: {reason}")
        if first["type"] == "model_type" and not first["loc"]:
            return cls(400, "the request body must be a JSON object")
        param = _param(first["loc"])
        msg = str(first["msg"]).removeprefix("Value error, ")
        return cls(400, f"{param}: {msg}" if param else msg, param=param)


def unknown_model(name: str, served: str) -> ApiError:
    message = f"the model {name!r} does not exist; this server serves {served!r}"
    return ApiError(404, message, param="model", code="model_not_found")


def _param(loc: tuple[int | str, ...]) -> str | None:
    # Union branches show up in `loc` as type names ("list[int]"); keep field names and
    # list indices only.
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (p.isidentifier() and p.islower() and p not in _TYPE_TAGS)
    ]
    return ".".join(parts) or None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class RequestBody(StrictModel):
    """A request's top-level object: fields it does not know are logged, then ignored."""

    @model_validator(mode="before")
    @classmethod
    def _log_unknown(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not log.isEnabledFor(logging.DEBUG):
            return data  # not an object: the model's own check says so
        if unknown := sorted(data.keys() - cls.model_fields.keys()):
            log.debug("%s: ignoring unknown fields %s", cls.__name__, ", ".join(unknown))
        return data


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = ""  # null is "" (an assistant message that only calls tools)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, value: list[ToolCall] | None, info: ValidationInfo) -> Any:
        if value and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages make tool calls")
        return value

    def to_dict(self) -> dict[str, Any]:
        # "developer" is OpenAI's new name for "system"; chat templates know "system".
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class _GenerateRequest(RequestBody, GuidedFields):
    """The fields chat and completions share: sampling, stopping, streaming, structured
    output (GuidedFields)."""

    model: str
    max_tokens: Annotated[int, Field(ge=1, lt=MAX_COUNT)] | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, lt=MAX_COUNT)] | None = None  # 0 or -1 = off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: StopStrings = Field(default_factory=list)
    stop_token_ids: list[TokenId] | None = None
    n: NumChoices | None = Field(
        None, description="choices of the one prompt (1-16), each sampled on its own"
    )
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: Annotated[int, Field(ge=0, lt=MAX_COUNT)] = 0
    logit_bias: LogitBias | None = None
    bad_words: BadWords | None = None  # vLLM's: words the output never completes
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    async def check(self) -> None:
        """Raise a 400 naming the field when xgrammar cannot compile a constraint."""
        if (found := await first_problem(self.checks)) is not None:
            guided, reason = found
            raise ApiError(400, f"{guided.param}: {reason}", param=guided.param)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives to return per token; None = no logprobs."""
        return None

    @property
    def num_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self) -> dict[str, Any]:
        """SamplingParams fields; max_tokens is left out when not given (engine default)."""
        out: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": max(self.top_k or 0, 0),
            "min_p": self.min_p or 0.0,
            "repetition_penalty": self.repetition_penalty or 1.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "logit_bias": [[int(k), v] for k, v in (self.logit_bias or {}).items()],
            "bad_words": list(self.bad_words or ()),  # text: the tokenizer makes them ids
            "seed": self.seed,
            "min_new_tokens": self.min_tokens,
            "stop_token_ids": list(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.num_logprobs,
        }
        if self.num_max_tokens is not None:
            out["max_tokens"] = self.num_max_tokens
        if (guided := self.guided) is not None:
            out["guided"] = guided.wire()
        return out


class ChatCompletionRequest(_GenerateRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, lt=MAX_COUNT)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Tools | None = None
    # "auto" when tools are given, else "none" (after validation, never None)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: TemplateKwargs | None = None  # extra chat template variables
    functions: Annotated[Any, not_supported("use tools")] = None  # deprecated by OpenAI
    function_call: Annotated[Any, not_supported("use tool_choice")] = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_the_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if value in (None, "none", "auto"):
            return value
        names = [t.function.name for t in info.data.get("tools") or ()]
        what = "'required'" if value == "required" else "a named function"
        if not names:
            raise ValueError(f"{what} needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(
                f"names {value.function.name!r}, which is not among the tools ({', '.join(names)})"
            )
        if (other := constraint_in(info.data)) is not None:
            raise ValueError(f"{what} constrains the output, as {other} does; give one of them")
        return value

    @model_validator(mode="after")
    def _default_tool_choice(self) -> ChatCompletionRequest:
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        return self

    @functools.cached_property
    def guided(self) -> Guided | None:
        choice, tools = self.tool_choice, self.tools or []
        if choice == "required":
            schema = tool_calls_schema(tools, parallel=self.parallel_tool_calls)
            return Guided("json", schema_text(schema), "tool_choice")
        if isinstance(choice, NamedToolChoice):
            i = next(i for i, t in enumerate(tools) if t.function.name == choice.function.name)
            parameters = tools[i].function.parameters or ANY_OBJECT
            return Guided("json", schema_text(parameters), f"tools.{i}.function.parameters")
        return super().guided

    @property
    def checks(self) -> list[Guided]:
        if self.tool_choice != "required":
            return super().checks
        each = [  # each tool's own schema first, so that a 400 names the one to blame
            Guided("json", schema_text(t.function.parameters), f"tools.{i}.function.parameters")
            for i, t in enumerate(self.tools or ())
            if t.function.parameters is not None
        ]
        return [*each, *super().checks]

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def text_request(
        self, request_id: str, reply_to: str, sent_at: float = 0.0
    ) -> protocol.TextRequest:
        return protocol.TextRequest(
            request_id=request_id,
            reply_to=reply_to,
            sent_at=sent_at,
            messages=[m.to_dict() for m in self.messages],
            prompt=None,
            sampling=self.sampling(),
            stop=self.stop,
            skip_special_tokens=self.skip_special_tokens,
            prompt_ids=b"",
            # rendered whatever tool_choice says, "none" too (as vLLM does by default)
            tools=[t.for_template() for t in self.tools] if self.tools else None,
            chat_template_kwargs=self.chat_template_kwargs,
            n=self.num_choices,
        )


class CompletionRequest(_GenerateRequest):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=1, lt=MAX_COUNT)] | None = 16  # OpenAI's default here
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: Annotated[bool, not_supported()] | None = False
    best_of: Annotated[int, Field(ge=1, le=protocol.MAX_CHOICES)] | None = Field(
        None, description="only equal to n"
    )
    suffix: Annotated[str, not_supported()] | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        """OpenAI's best_of picks the n best of best_of choices: only best_of = n, where
        there is nothing to pick, is served."""
        n = info.data.get("n") or 1
        if value is not None and value != n:
            raise ValueError(f"only best_of equal to n ({n}) is supported, got {value}")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def text_request(
        self, request_id: str, reply_to: str, sent_at: float = 0.0
    ) -> protocol.TextRequest:
        ids = self.prompt if isinstance(self.prompt, list) else None
        return protocol.TextRequest(
            request_id=request_id,
            reply_to=reply_to,
            sent_at=sent_at,
            messages=None,
            prompt=self.prompt if isinstance(self.prompt, str) else None,
            sampling=self.sampling(),
            stop=self.stop,
            skip_special_tokens=self.skip_special_tokens,
            prompt_ids=protocol.pack_ids(ids) if ids else b"",
            n=self.num_choices,
        )
