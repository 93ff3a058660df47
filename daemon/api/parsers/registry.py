"""The parsers by name, and the tool-call format a chat template teaches its model.

The names are the config's (config.TOOL_CALL_PARSERS, config.REASONING_PARSERS: the
shared layer cannot import the api); tests check the two agree.
"""

from __future__ import annotations

from lmd.api.parsers.reasoning import DEEPSEEK_R1, QWEN3, ThinkSyntax
from lmd.api.parsers.tool_calls import HERMES, LLAMA3_JSON, MISTRAL, Syntax

AUTO = "auto"  # --tool-call-parser's default: the format the chat template names
TOOL_PARSERS: dict[str, Syntax] = {s.name: s for s in (HERMES, LLAMA3_JSON, MISTRAL)}
REASONING_PARSERS: dict[str, ThinkSyntax] = {s.name: s for s in (DEEPSEEK_R1, QWEN3)}

# What in a chat template's text says which format its model writes calls in, first
# match wins: Mistral's and Llama 3's templates name their own tokens; Hermes-style
# ones (Qwen2.5, Qwen3, Hermes 2/3) teach <tool_call>.
_TEMPLATE_MARKS = (
    ("[TOOL_CALLS]", MISTRAL),
    ("<tool_call>", HERMES),
    ("<|python_tag|>", LLAMA3_JSON),
    ("ipython", LLAMA3_JSON),  # Llama 3's role for tool results
)


def detect_tool_format(template: str) -> tuple[Syntax, str]:
    """The tool-call format a chat template's text asks for, and why (for the log).
    A template that names none gets hermes, the format most open models use."""
    for mark, syntax in _TEMPLATE_MARKS:
        if mark in template:
            return syntax, f"the chat template mentions {mark}"
    return HERMES, "the chat template names no tool-call format; hermes, the most common"
