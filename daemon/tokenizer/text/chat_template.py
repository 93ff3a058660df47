"""Chat templates: OpenAI `messages` -> the prompt text the model was trained on.

Two kinds, one interface (ChatTemplate):
  HfChatTemplate         the model's own Hugging Face (Jinja) template, the default
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
  `model_path` is accepted and unused.

A chat whose last message is from the assistant is continued: that message is left
open (no end marker) and no new generation prompt follows, in both kinds (LMDeploy's
behaviour; HF's `continue_final_message`).

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

ROLES = ("system", "user", "assistant", "tool")
CAPABILITIES = ("completion", "infilling", "chat", "python")


class ChatTemplateError(ValueError):
    """A chat that cannot be rendered, or a template file that cannot be used."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One validated chat message, its content flattened to text."""

    role: str  # one of ROLES
    content: str


def parse_messages(messages: Sequence[Mapping[str, Any]]) -> list[ChatMessage]:
    """Validate OpenAI chat messages and flatten their content to text.

    `content` is a string or a list of `{"type": "text", "text": ...}` parts, joined
    with newlines (as vLLM does); an assistant message may have null content. Other
    keys (`name`, ...) are ignored. Raises ChatTemplateError saying which message is
    wrong.
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
        parsed.append(ChatMessage(role, _content_text(message.get("content"), role, i)))
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


class ChatTemplate(ABC):
    """Renders a chat into prompt text."""

    @abstractmethod
    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> str:
        """The prompt for `messages`. With add_generation_prompt (the default) it ends
        where the model's reply begins (or continues a final assistant message);
        without it, every message is closed: the chat as history."""

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


class HfTemplateTokenizer(Protocol):
    """The part of a transformers tokenizer that renders its chat template."""

    @property
    def chat_template(self) -> object: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


class HfChatTemplate(ChatTemplate):
    """The model's own chat template, through transformers' apply_chat_template."""

    def __init__(self, tokenizer: HfTemplateTokenizer) -> None:
        if not tokenizer.chat_template:
            raise ChatTemplateError(
                "the model has no chat template; give one with --chat-template FILE.json"
            )
        self._tokenizer = tokenizer

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> str:
        if not messages:
            raise ChatTemplateError("messages must contain at least one message")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        continue_final = add_generation_prompt and messages[-1].role == "assistant"
        try:
            text = self._tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
            )
        except Exception as exc:  # Jinja errors (raise_exception), no template, ...
            raise ChatTemplateError(f"the model's chat template rejected the chat: {exc}") from exc
        if not isinstance(text, str):
            raise ChatTemplateError(f"the model's chat template returned {type(text).__name__}")
        return text


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
    def load(cls, path: Path) -> LmdeployChatTemplate:
        """Read a ChatTemplateConfig JSON file (`--chat-template FILE.json`)."""
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ChatTemplateError(f"cannot read chat template {path}: {exc.strerror}") from exc
        return cls.from_json(text, source=str(path))

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

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> str:
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
        if messages and messages[-1].role == "assistant":
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
