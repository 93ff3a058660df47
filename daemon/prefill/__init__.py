"""Prefill role: `scheduler` (pure, no I/O) packs prompts into chunked prefill steps."""

from __future__ import annotations
