"""Chat templates: OpenAI `messages` -> the prompt text the model was trained on.

Two kinds, one interface (ChatTemplate):
  HfChatTemplate         a Hugging Face (Jinja) template through transformers'
                         apply_chat_template: the model's own (the default), or the one
                         `--chat-template FILE.jinja` gives (a file that is not JSON)
  LmdeployChatTemplate   LMDeploy's ChatTemplateConfig, loaded from `--chat-template
                         FILE.json`, concatenated exactly as LMDeploy's BaseChatTemplate:
    [{system}{meta_instruction}{eosys}]    only when the chat has no system message first
    {system}{content}{eosys}               a system message
    {user}{content}{eoh}                   a user message
    {assistant}{content}{eoa}{separator}   an assistant message
    {tool}{content}{eotool}                a tool message
    {assistant}                            the generation prompt
  As in LMDeploy, a field left out or null is "", `model_name` only names the template
  (LMDeploy's built-in templates are not bundled: write out every field you need), and
  `model_path` is accepted and unused. It has no place for tool definitions or tool
  calls: a chat that brings them is refused (ChatTemplateError, a 400).

Jinja templates get the request's `tools` (the function definitions, as
apply_chat_template takes them) and its `chat_template_kwargs` as template variables
(e.g. Qwen3's `enable_thinking`); a variable the template does not use changes nothing.

A chat whose last message is from the assistant (and makes no tool call) is continued:
that message is left open (no end marker) and no new generation prompt follows, in both
kinds (LMDeploy's behaviour; HF's `continue_final_message`).

Interactive sessions (LMDeploy's /v1/chat/interactive) keep earlier turns on the
server; render_increment() gives only the text to append to what the session holds.
"""

from __future__ import annotations

import difflib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from lmd.tokenizer.text.chat_messages import ChatMessage, ChatTemplateError, parse_messages

__all__ = [
    "ChatMessage",
    "ChatTemplate",
    "ChatTemplateError",
    "HfChatTemplate",
    "LmdeployChatTemplate",
    "load_chat_template",
    "parse_messages",
    "read_chat_template",
]

CAPABILITIES = ("completion", "infilling", "chat", "python")
JINJA_SUFFIXES = (".jinja", ".j2")


class ChatTemplate(ABC):
    """Renders a chat into prompt text."""

    @abstractmethod
    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for `messages`. With add_generation_prompt (the default) it ends
        where the model's reply begins (or continues a final assistant message);
        without it, every message is closed: the chat as history. `tools`: function
        definitions for the model ({"type": "function", "function": {...}});
        `template_kwargs`: extra template variables."""

    @property
    def stop_words(self) -> tuple[str, ...]:
        """Strings that end a reply under this template, to add to the stop strings."""
        return ()

    def render_prompt(self, prompt: str) -> str:
        """A bare prompt string (an interactive session's first turn) as one user turn."""
        return self.render([ChatMessage("user", prompt)])

    def render_increment(self, previous: str, messages: Sequence[ChatMessage]) -> str:
        """The text to append to `previous` so that the result is render(messages).

        `previous` is what an interactive session holds: an earlier prompt, usually
        followed by the reply generated to it (with its end marker, e.g. `<|im_end|>`);
        `messages` is the whole chat, earlier turns, that reply and the new turn.
        Raises ChatTemplateError when render(messages) does not start with `previous`
        (the template renders earlier turns differently once a turn is added, or the
        chat's earlier turns are not what the session holds): then the session must be
        prefilled again from the start. Tokenize the returned text on its own.
        """
        full = self.render(messages)
        if not full.startswith(previous):
            raise ChatTemplateError(
                "the chat template does not render this chat as an extension of the "
                "session's history; start a new session with the whole conversation"
            )
        return full[len(previous) :]


def continues(messages: Sequence[ChatMessage]) -> bool:
    """Whether a generation continues the chat's last message (an unfinished reply)."""
    return bool(messages) and messages[-1].role == "assistant" and not messages[-1].tool_calls


class HfTemplateTokenizer(Protocol):
    """The part of a transformers tokenizer that renders its chat template."""

    @property
    def chat_template(self) -> object: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


class HfChatTemplate(ChatTemplate):
    """A Jinja chat template through transformers' apply_chat_template: the tokenizer's
    own, or `template` (the text of a `--chat-template` file, checked by jinja_template)."""

    def __init__(self, tokenizer: HfTemplateTokenizer, template: str | None = None) -> None:
        if not (template or tokenizer.chat_template):
            raise ChatTemplateError(
                "the model has no chat template; give one with --chat-template FILE "
                "(a Jinja template, or LMDeploy's JSON)"
            )
        self._tokenizer = tokenizer
        self._template = template  # None: the tokenizer's

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if not messages:
            raise ChatTemplateError("messages must contain at least one message")
        continue_final = add_generation_prompt and continues(messages)
        try:
            text = self._tokenizer.apply_chat_template(
                [m.to_template() for m in messages],
                tools=tools,
                chat_template=self._template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # Jinja errors (raise_exception), no template, ...
            raise ChatTemplateError(f"the model's chat template rejected the chat: {exc}") from exc
        if not isinstance(text, str):
            raise ChatTemplateError(f"the model's chat template returned {type(text).__name__}")
        return text


def jinja_template(text: str, *, source: str) -> str:
    """`text` if it parses as a chat template (transformers' own Jinja environment);
    else ChatTemplateError naming `source` and the line."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"{source}: not a valid Jinja chat template: line {exc.lineno}: {exc.message}"
        ) from None
    return text


def read_chat_template(path: Path) -> LmdeployChatTemplate | str:
    """A `--chat-template` file: LMDeploy's JSON, or a Jinja template's checked text (a
    file named *.jinja or *.j2, or one that is not JSON). Raises ChatTemplateError."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ChatTemplateError(f"cannot read chat template {path}: {reason}") from exc
    suffix = path.suffix.lower()
    if suffix not in JINJA_SUFFIXES and (suffix == ".json" or _is_json(text)):
        return LmdeployChatTemplate.from_json(text, source=str(path))
    return jinja_template(text, source=str(path))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def load_chat_template(path: Path, tokenizer: HfTemplateTokenizer) -> ChatTemplate:
    """The ChatTemplate of a `--chat-template` file (read_chat_template's rules)."""
    template = read_chat_template(path)
    if isinstance(template, str):
        return HfChatTemplate(tokenizer, template)
    return template


@dataclass(frozen=True, slots=True)
class LmdeployChatTemplate(ChatTemplate):
    """LMDeploy's ChatTemplateConfig fields, rendered as LMDeploy's BaseChatTemplate."""

    model_name: str
    model_path: str = ""
    system: str = ""
    meta_instruction: str = ""
    eosys: str = ""
    user: str = ""
    eoh: str = ""
    assistant: str = ""
    eoa: str = ""
    tool: str = ""
    eotool: str = ""
    separator: str = ""
    capability: str = "chat"
    stop_words: tuple[str, ...] = ()  # overrides ChatTemplate.stop_words

    def __post_init__(self) -> None:
        if self.capability not in CAPABILITIES:
            raise ChatTemplateError(
                f"capability must be one of {', '.join(CAPABILITIES)}, got {self.capability!r}"
            )

    @classmethod
    def from_json(cls, text: str, *, source: str = "chat template") -> LmdeployChatTemplate:
        """Parse ChatTemplateConfig JSON; errors name `source` and the offending field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ChatTemplateError(f"{source}: not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ChatTemplateError(f"{source}: expected a JSON object of template fields")
        return cls.from_dict(data, source=source)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, object], *, source: str = "chat template"
    ) -> LmdeployChatTemplate:
        """Build from ChatTemplateConfig fields; null means the default, as in LMDeploy."""
        names = [f.name for f in fields(cls)]
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ChatTemplateError(
                    f"{source}: unknown field {key!r}{hint}; known fields: {', '.join(names)}"
                )
            if value is None:
                continue
            if key == "stop_words":
                if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
                    raise ChatTemplateError(
                        f"{source}: field 'stop_words' must be a list of strings or null, "
                        f"got {value!r}"
                    )
                kwargs[key] = tuple(value)
            elif isinstance(value, str):
                kwargs[key] = value
            else:
                raise ChatTemplateError(
                    f"{source}: field {key!r} must be a string or null, "
                    f"got {value!r} ({type(value).__name__})"
                )
        if "model_name" not in kwargs:
            raise ChatTemplateError(f"{source}: field 'model_name' (a string) is required")
        try:
            return cls(**kwargs)
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"{source}: {exc}") from None

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,  # no variables: ignored
    ) -> str:
        if tools or any(m.tool_calls for m in messages):
            raise ChatTemplateError(
                "the chat template (LMDeploy's JSON, --chat-template) has no place for tools "
                "or tool calls; serve the model with its own template or a Jinja one"
            )
        box = {"system": self.system, "user": self.user, "assistant": self.assistant}
        eox = {"system": self.eosys, "user": self.eoh, "assistant": self.eoa + self.separator}
        box["tool"], eox["tool"] = self.tool, self.eotool
        parts = []
        if messages and messages[0].role != "system":
            # LMDeploy's default system prompt: only when the chat brings none.
            parts.append(f"{self.system}{self.meta_instruction}{self.eosys}")
        for m in messages:
            parts.append(f"{box[m.role]}{m.content}{eox[m.role]}")
        if not add_generation_prompt:
            return "".join(parts)
        if continues(messages):
            # Continue the reply: LMDeploy cuts its end marker (eoa + separator) off.
            parts[-1] = f"{self.assistant}{messages[-1].content}"
            return "".join(parts)
        parts.append(self.assistant)
        return "".join(parts)

    def render_prompt(self, prompt: str) -> str:
        """LMDeploy's get_prompt for a session's first turn; 'completion' templates
        pass the prompt through unchanged."""
        if self.capability == "completion":
            return prompt
        return ChatTemplate.render_prompt(self, prompt)
