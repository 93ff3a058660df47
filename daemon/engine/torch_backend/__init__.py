"""The torch backend: Hugging Face causal LMs through transformers, with paged attention."""

from __future__ import annotations

from lmd.engine.torch_backend.model import TorchBackend

__all__ = ["TorchBackend"]
