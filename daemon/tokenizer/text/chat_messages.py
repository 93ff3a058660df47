"""OpenAI chat messages as the chat templates take them: validated, content flattened to
text, tool calls kept.

An assistant message may carry `tool_calls` (its content may then be null) and a `tool`
message answers one with `tool_call_id`; `name` is kept where given. OpenAI clients send
a call's `function.arguments` as JSON text; templates want them as an object (Llama 3.x,
Mistral and Hermes templates iterate or `tojson` them; Qwen3's takes either), so
arguments that are a JSON object are handed over parsed, as vLLM does, and anything else
as the text it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A chat that cannot be rendered, or a template file that cannot be used."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One validated chat message, its content flattened to text."""

    role: str  # one of ROLES
    content: str
    # assistant: [{"id", "type": "function", "function": {"name", "arguments"}}], arguments
    # parsed to a dict when they are a JSON object
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as a Jinja chat template reads it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def parse_messages(messages: Sequence[Mapping[str, Any]]) -> list[ChatMessage]:
    """Validate OpenAI chat messages and flatten their content to text.

    `content` is a string or a list of `{"type": "text", "text": ...}` parts, joined
    with newlines (as vLLM does); an assistant message may have null content. Other
    keys are ignored. Raises ChatTemplateError saying which message is wrong.
    """
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}"
            )
        parsed.append(
            ChatMessage(
                role,
                _content_text(message.get("content"), role, i),
                _tool_calls(message.get("tool_calls"), role, i),
                _optional_text(message, "tool_call_id", i),
                _optional_text(message, "name", i),
            )
        )
    return parsed


def _content_text(content: object, role: str, index: int) -> str:
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise ChatTemplateError(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ChatTemplateError(
                f"{where}[{j}] has type {kind!r}: only {{'type': 'text', 'text': ...}} parts "
                "are supported by this text-only model"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}[{j}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


def _optional_text(message: Mapping[str, Any], key: str, index: int) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise ChatTemplateError(f"messages[{index}].{key} must be a string")
    return value


def _tool_calls(calls: object, role: str, index: int) -> tuple[dict[str, Any], ...]:
    where = f"messages[{index}].tool_calls"
    if not calls:
        return ()
    if role != "assistant":
        raise ChatTemplateError(f"{where}: only assistant messages make tool calls")
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"{where}[{j}] must be {{'function': {{'name', 'arguments'}}}}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            arguments = _object_or_text(arguments)
        out.append({**call, "function": {**function, "arguments": arguments}})
    return tuple(out)


def _object_or_text(arguments: str) -> dict[str, Any] | str:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments
