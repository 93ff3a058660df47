"""lmd.pipeline: LMDeploy's `pipeline()` API, the engine in-process (docs in pipeline.py).

    from lmd import pipeline, GenerationConfig

    pipe = pipeline()                           # or pipeline("path/to/model", backend_config=...)
    print(pipe("Hi!", gen_config=GenerationConfig(max_new_tokens=16)).text)

As `from lmdeploy import pipeline` gives a function, `from lmd import pipeline` gives this
package, which can be called as that function (`pipeline(...)` is `pipeline.pipeline(...)`).
Nothing else in lmd imports it: `import lmd` and the daemon's processes never load it.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from lmd.pipeline.config import (
    ChatTemplateConfig,
    GenerationConfig,
    PytorchEngineConfig,
    TurbomindEngineConfig,
)
from lmd.pipeline.outputs import Response
from lmd.pipeline.pipeline import Pipeline, pipeline
from lmd.pipeline.session import Session

__all__ = [
    "ChatTemplateConfig",
    "GenerationConfig",
    "Pipeline",
    "PytorchEngineConfig",
    "Response",
    "Session",
    "TurbomindEngineConfig",
    "pipeline",
]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Pipeline:
        return pipeline(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
