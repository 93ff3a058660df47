"""Structured output: the request fields that constrain the output, what they become for
the engine, and their check before the request is admitted.

The engine takes `sampling["guided"] = [kind, spec]` (absent: free output):
  "json"     a JSON schema as JSON text, or "" for any JSON object
  "regex"    a regular expression the whole output matches
  "grammar"  an EBNF grammar in xgrammar's dialect (GBNF-like, `root ::= ...`)
What maps to it (at most one per request):
  response_format {"type": "json_object"}                   -> json ""
  response_format {"type": "json_schema", "json_schema": {"schema": S}} -> json S
  response_format {"type": "regex_schema", "regex_schema": R} (LMDeploy's) -> regex R
  guided_json (object or JSON text), guided_regex, guided_grammar (vLLM's)
  guided_choice [A, B, ...] (vLLM's)                        -> regex (A|B|...), escaped
  tool_choice "required"  -> json: an array (1 item when parallel_tool_calls is false) of
                             {"name": one tool's name, "parameters": its arguments}
  tool_choice {"function": {"name": N}} -> json: N's parameters schema

`problem` compiles a spec with xgrammar (the library the engine uses; imported on the
first request that needs it, off the event loop) so that a bad schema, pattern or grammar
is a 400 naming its field, not a failed engine step. Results are cached by spec.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from lmd.api.openai_fields import StrictModel
from lmd.api.openai_tools import TOOL_NAME, Tool

ANY_OBJECT = {"type": "object"}  # the arguments of a function that declares none
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")


@dataclass(frozen=True, slots=True)
class Guided:
    """One constraint: the engine's [kind, spec], and the request field it came from."""

    kind: str  # json | regex | grammar
    spec: str
    param: str  # for a 400: the field to blame

    def wire(self) -> list[str]:
        return [self.kind, self.spec]


# Every request field that constrains the output, in the order they are validated.
CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")


class JsonSchemaFormat(StrictModel):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema", "regex_schema"]
    json_schema: JsonSchemaFormat | None = None
    regex_schema: Annotated[str, Field(min_length=1)] | None = None  # LMDeploy's

    @model_validator(mode="after")
    def _has_its_spec(self) -> ResponseFormat:
        if self.type in ("json_schema", "regex_schema") and getattr(self, self.type) is None:
            raise ValueError(f"type {self.type!r} needs the {self.type} field")
        return self

    def guided(self) -> Guided | None:
        if self.type == "json_object":
            return Guided("json", "", "response_format")
        if self.json_schema is not None:
            schema = self.json_schema.schema_
            text = "" if schema is None else schema_text(schema)
            return Guided("json", text, "response_format.json_schema.schema")
        if self.regex_schema is not None:
            return Guided("regex", self.regex_schema, "response_format.regex_schema")
        return None


def constraint_in(data: dict[str, Any]) -> str | None:
    """The first field of CONSTRAINTS set in (validated) request fields `data`."""
    for name in CONSTRAINTS:
        value = data.get(name)
        if value is not None and not (isinstance(value, ResponseFormat) and value.type == "text"):
            return name
    return None


def _json_object(value: Any) -> Any:
    """guided_json: a schema object, or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON schema object")
    return value


GuidedJson = Annotated[
    dict[str, Any],
    BeforeValidator(_json_object),
    WithJsonSchema({"anyOf": [{"type": "object"}, {"type": "string"}]}),
]

NonEmpty = Annotated[str, Field(min_length=1)]


class GuidedFields(StrictModel):
    """The fields of chat and completions requests that constrain the output (at most
    one of them)."""

    response_format: ResponseFormat | None = None
    guided_json: GuidedJson | None = None  # vLLM's
    guided_regex: NonEmpty | None = None
    guided_grammar: NonEmpty | None = None
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None

    @field_validator(*CONSTRAINTS[1:])
    @classmethod
    def _one_constraint(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and (other := constraint_in(info.data)) is not None:
            raise ValueError(f"{other} constrains the output already; give one of them")
        return value

    @functools.cached_property
    def guided(self) -> Guided | None:
        """What constrains the output (the engine's sampling["guided"]); None: nothing.
        Built once per request: the check, the sampling and the reply parsers read it."""
        if self.response_format is not None and (found := self.response_format.guided()):
            return found
        if self.guided_json is not None:
            return Guided("json", schema_text(self.guided_json), "guided_json")
        if self.guided_regex is not None:
            return Guided("regex", self.guided_regex, "guided_regex")
        if self.guided_grammar is not None:
            return Guided("grammar", self.guided_grammar, "guided_grammar")
        if self.guided_choice is not None:
            return Guided("regex", choice_regex(self.guided_choice), "guided_choice")
        return None

    @property
    def checks(self) -> list[Guided]:
        """The constraints to compile before the request is admitted."""
        return [] if self.guided is None else [self.guided]


def schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of `choices` (each taken literally)."""
    escaped = ("".join("\\" + c if c in _REGEX_SPECIAL else c for c in s) for s in choices)
    return "(" + "|".join(escaped) + ")"


def tool_calls_schema(tools: Sequence[Tool], *, parallel: bool) -> dict[str, Any]:
    """The JSON schema of tool_choice "required": calls as [{"name", "parameters"}]."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "parameters": t.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


async def first_problem(checks: Sequence[Guided]) -> tuple[Guided, str] | None:
    """The first check that xgrammar refuses, with its reason; None when all compile."""
    if not checks:
        return None
    return await asyncio.to_thread(_first_problem, tuple(checks))


def _first_problem(checks: tuple[Guided, ...]) -> tuple[Guided, str] | None:
    for check in checks:
        reason = problem(check.kind, check.spec)
        if reason is not None:
            return check, reason
    return None


@functools.lru_cache(maxsize=512)
def problem(kind: str, spec: str) -> str | None:
    """Why the engine would refuse this constraint (engine/grammar.py's own checks: its
    size, then xgrammar's parse); None when it compiles."""
    from lmd.engine.grammar import check_guided, check_spec

    try:
        check_guided((kind, spec))
        check_spec(kind, spec)
    except ValueError as exc:
        return str(exc)
    return None
