"""Tool calling in a chat request: `tools`, `tool_choice`, and the tool calls an assistant
message carries in later turns (OpenAI's shapes).

  tools          up to MAX_TOOLS {"type": "function", "function": {name, description?,
                 parameters? (a JSON schema object), strict?}}; names unique and as
                 OpenAI allows them (TOOL_NAME)
  tool_choice    "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
                 naming one of the tools; "auto" when tools are given, else "none"
                 ("required" and a named tool need tools)
The definitions reach the model through its chat template (`Tool.for_template`); "required"
and a named tool are enforced with constrained decoding (guided.py builds the schema).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from lmd.api.openai_fields import StrictModel

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
# apply_chat_template's own parameters and the variables it sets itself: a
# chat_template_kwargs key of these names would change how lmd renders, not the template
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """The definition as chat templates (and transformers) take it; unset keys left out."""
        return self.model_dump(exclude_none=True)


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(StrictModel):
    """A call an earlier assistant turn made (sent back in a later request)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _unique_names(tools: list[Tool]) -> list[Tool]:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise ValueError(f"tools.{i}: a second function named {tool.function.name!r}")
        seen.add(tool.function.name)
    return tools


def _template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    for key in value:
        if not key.isidentifier():
            raise ValueError(f"keys must be template variable names, got {key!r}")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"{key!r} is set by the server, not by chat_template_kwargs")
    return value


def _one_named(value: Any) -> Any:
    # A string that is none of the three modes: say what is allowed (pydantic's union
    # error would list a failure per member).
    if isinstance(value, str) and value not in ("none", "auto", "required"):
        raise ValueError(f"must be 'none', 'auto', 'required' or a named function, got {value!r}")
    return value


Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS), AfterValidator(_unique_names)]
ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice, BeforeValidator(_one_named)
]
TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_template_kwargs)]
