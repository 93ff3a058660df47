"""Shared by every test: one model cache per checkout, and the default model's directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The GGUF -> HF conversion of the default model (~25 s) happens once per checkout, and
# the daemons that integration tests start inherit the same cache.
os.environ.setdefault(
    "LMD_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "lmd-models")
)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face directory (with tokenizer.json)."""
    from lmd.engine.model_source import ModelSourceError, resolve_model

    try:
        return resolve_model(None).path
    except ModelSourceError as exc:
        pytest.skip(str(exc))
