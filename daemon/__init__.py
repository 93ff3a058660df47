"""lmd: a disaggregated LLM serving daemon, and its engine in-process (`lmd.pipeline`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from lmd.pipeline import ChatTemplateConfig as ChatTemplateConfig
    from lmd.pipeline import GenerationConfig as GenerationConfig
    from lmd.pipeline import Pipeline as Pipeline
    from lmd.pipeline import PytorchEngineConfig as PytorchEngineConfig
    from lmd.pipeline import Response as Response
    from lmd.pipeline import Session as Session
    from lmd.pipeline import TurbomindEngineConfig as TurbomindEngineConfig
    from lmd.pipeline.pipeline import pipeline as pipeline

# LMDeploy's names, loaded on first use: `import lmd` (every daemon process does) stays
# cheap. `pipeline` is the lmd.pipeline package, which can be called as the function.
PIPELINE_NAMES = (
    "ChatTemplateConfig",
    "GenerationConfig",
    "Pipeline",
    "PytorchEngineConfig",
    "Response",
    "Session",
    "TurbomindEngineConfig",
)


def __getattr__(name: str) -> Any:
    if name == "pipeline":
        return importlib.import_module("lmd.pipeline")
    if name in PIPELINE_NAMES:
        return getattr(importlib.import_module("lmd.pipeline"), name)
    raise AttributeError(f"module 'lmd' has no attribute {name!r}")
