"""Engine parts shared by the prefill and decode workers.

`config` (EngineConfig), `sequence` (Sequence, SamplingParams), `block_manager`
(paged block bookkeeping and prefix cache), `kv_pool` (the one KV tensor and its sizing)
and `sampler` (batched token choice). Nothing here does I/O; torch is only imported by
the modules that touch tensors.
"""

from __future__ import annotations
