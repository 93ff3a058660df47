"""The field types of OpenAI requests (openai_schema.py's models): bounds, what a field
may be given as, and how the OpenAPI document describes it."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from lmd.engine.sequence import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
)
from lmd.protocol import MAX_CHOICES

MAX_TEMPERATURE = 2.0  # OpenAI's (the engine itself takes up to engine.sequence's)
MAX_STOP_STRINGS = 16
# Token counts and ids travel as int32 and every integer as a JSON int64 inside lmd: a
# larger number is a 400 here, never a failure further down.
MAX_COUNT = 2**31


class StrictModel(BaseModel):
    """A request object: no coercion (a string where a number belongs is a 400), unknown
    keys ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _one_prompt(value: Any) -> Any:
    """A completion prompt: text, or token ids; a batch of one is unwrapped."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) > 1:
            raise ValueError(
                f"{len(value)} prompts in one request are not supported; "
                "send one request per prompt"
            )
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be empty")
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of token ids")
    if not value:
        raise ValueError("must not be an empty list of token ids")
    for i, token_id in enumerate(value):
        if (
            isinstance(token_id, bool)
            or not isinstance(token_id, int)
            or not 0 <= token_id < MAX_COUNT
        ):
            raise ValueError(f"token id {token_id!r} at position {i} is not an integer >= 0")
    return value


def _stop_list(value: Any) -> Any:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if isinstance(stops, list):
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
    return stops


def _text_content(value: Any) -> Any:
    """Message content: a string, or a list of text parts joined into one string."""
    if not isinstance(value, list):
        return "" if value is None else value
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"only text content parts are supported, got type {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _logit_bias(value: dict[str, float]) -> dict[str, float]:
    """OpenAI's {"token id": bias}: ids as decimal strings, biases in [-100, 100]."""
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"takes at most {MAX_LOGIT_BIAS} tokens")
    for key, bias in value.items():
        if not key.isdecimal() or int(key) >= 2**31:
            raise ValueError(f"keys must be token ids, got {key!r}")
        if not -100 <= bias <= 100:
            raise ValueError(f"biases must be in [-100, 100], got {bias:g} for {key}")
    return value


def not_supported(instead: str = "") -> Any:
    """A validator: any value but the neutral one is a 400 naming the field."""

    def check(value: Any) -> Any:
        if value:
            raise ValueError(
                "is not supported by this server" + (f"; {instead}" if instead else "")
            )
        return value

    return AfterValidator(check)


TokenId = Annotated[int, Field(ge=0, lt=MAX_COUNT)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63)]  # int64, as OpenAI's
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)]
RepetitionPenalty = Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)]
# What the validators above take, for /openapi.json (the annotated types say what they give).
_TEXT = {"type": "string", "minLength": 1}
_IDS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "exclusiveMaximum": MAX_COUNT},
    "minItems": 1,
}
_PROMPT_DOC = {
    "anyOf": [
        _TEXT,
        _IDS,
        *({"type": "array", "items": p, "minItems": 1, "maxItems": 1} for p in (_TEXT, _IDS)),
    ],
    "description": "text or token ids (a batch of one is taken)",
}
_STOP_DOC = {
    "anyOf": [
        _TEXT,
        {"type": "array", "items": _TEXT, "maxItems": MAX_STOP_STRINGS},
        {"type": "null"},
    ]
}
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_CONTENT_DOC = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]
}

Prompt = Annotated[str | list[int], BeforeValidator(_one_prompt), WithJsonSchema(_PROMPT_DOC)]
StopStrings = Annotated[list[str], BeforeValidator(_stop_list), WithJsonSchema(_STOP_DOC)]
Content = Annotated[str, BeforeValidator(_text_content), WithJsonSchema(_CONTENT_DOC)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
LogitBias = Annotated[dict[str, float], AfterValidator(_logit_bias)]
BadWords = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_BAD_WORDS)]
# OpenAI's n: choices sampled from the one prompt (tokenizer/choices.py), at most MAX_CHOICES
NumChoices = Annotated[int, Field(ge=1, le=MAX_CHOICES)]
