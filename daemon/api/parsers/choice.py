"""Which parsers read a chat request's reply: the config's, narrowed by the request.

- Reasoning (`--reasoning-parser`, none by default): every chat reply, unless the
  request constrains its output (`guided`: a named or required tool_choice,
  response_format json, guided_*), which has no <think> part to split. The request's
  `chat_template_kwargs.enable_thinking: false` says the prompt opened no thinking.
- Tool calls, when the request gave `tools` and tool_choice is not "none": a named
  function's arguments (named_call.py) or the "required" array (tool_calls.REQUIRED),
  both written under constrained decoding; else (`auto`) the model's own format,
  `--tool-call-parser`, or with `auto` the one its chat template names. That template
  is read once, at the first request that needs it (by then the tokenizer has loaded
  the model, a GGUF converted), in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from lmd.api.openai_schema import ChatCompletionRequest
from lmd.api.openai_tools import NamedToolChoice
from lmd.api.parsers.registry import AUTO, REASONING_PARSERS, TOOL_PARSERS, detect_tool_format
from lmd.api.parsers.reply import ReplyParser
from lmd.api.parsers.tool_calls import HERMES, REQUIRED, Syntax
from lmd.config import ServeConfig
from lmd.engine.model_source import resolve_model

log = logging.getLogger(__name__)


class ReplyChoice:
    """The api worker's parsers, from its config; `for_chat` picks a request's."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        name = config.reasoning_parser
        self.think = None if name is None else REASONING_PARSERS[name]
        self._tool_format: Syntax | None = TOOL_PARSERS.get(config.tool_call_parser)
        self._reading: asyncio.Future[Syntax] | None = None  # the template, read once

    async def tool_format(self) -> Syntax:
        """The format the model writes calls in (the template is read the first time)."""
        if self._tool_format is None:
            if self._reading is None:
                self._reading = asyncio.ensure_future(asyncio.to_thread(self._detect))
            self._tool_format = await asyncio.shield(self._reading)
        return self._tool_format

    def _detect(self) -> Syntax:
        assert self.config.tool_call_parser == AUTO
        try:
            template = chat_template_text(self.config)
        except (OSError, ValueError) as exc:  # ModelSourceError is a ValueError
            log.warning("tool calls: cannot read the chat template (%s); using hermes", exc)
            return HERMES
        syntax, why = detect_tool_format(template)
        log.info("tool calls are read as %s: %s (--tool-call-parser to choose)", syntax.name, why)
        return syntax

    async def for_chat(self, body: ChatCompletionRequest) -> ReplyParser | None:
        """The parsers of this request's reply; None: its text is the content as it is."""
        choice = body.tool_choice
        function: str | None = None
        syntax: Syntax | None = None
        if body.tools and choice != "none":
            if isinstance(choice, NamedToolChoice):
                function = choice.function.name
            elif choice == "required":
                syntax = REQUIRED
            else:
                syntax = await self.tool_format()
        # Constrained output (tool_choice, response_format, guided_*) has no <think> part.
        think = None if body.guided is not None else self.think
        if think is None and syntax is None and function is None:
            return None
        opened = None if think is None else think.opened
        if (body.chat_template_kwargs or {}).get("enable_thinking") is False:
            opened = False
        return ReplyParser(think, opened, syntax, function)


def chat_template_text(config: ServeConfig) -> str:
    """The text of the chat template the tokenizer renders with: --chat-template's
    file, else the model's (chat_template.jinja, or tokenizer_config.json's)."""
    if config.chat_template:
        return Path(config.chat_template).read_text(encoding="utf-8", errors="replace")
    return model_template_text(resolve_model(config.model).path)


def model_template_text(path: Path) -> str:
    """A Hugging Face directory's chat template; every named one, joined ("" if none)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8", errors="replace")
    config_file = path / "tokenizer_config.json"
    if not config_file.is_file():
        return ""
    template = json.loads(config_file.read_bytes()).get("chat_template") or ""
    if isinstance(template, list):  # named templates: default, tool_use, ...
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""
