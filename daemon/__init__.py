"""lmd: a disaggregated LLM serving daemon."""

from __future__ import annotations

__version__ = "0.1.0"
