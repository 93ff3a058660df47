"""Decode CUDA graphs behind a backend: captured for a KV pool, replayed for pure decode
steps. Shared by turbo and the torch backend (each builds its own `DecodeGraphs`,
turbo/graphs.py); importing this module imports neither triton nor a model.

A backend mixing in `GraphedDecode` sets `use_cuda_graphs` and `graphs` (None) in its
constructor and implements `new_graphs(kv, max_batch_size)`; its `forward` asks
`replay(batch, kv)` first and runs eagerly when that gives None.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Any

import torch
from torch import Tensor

from lmd.engine.backend import Backend
from lmd.engine.forward_batch import ForwardBatch

DEFAULT_MAX_GRAPH_BATCH = 512
DEFAULT_GRAPH_BUDGET_S = 60.0


class GraphedDecode(Backend):
    use_cuda_graphs: bool
    graphs: Any  # turbo.graphs.DecodeGraphs once captured, else None

    @abstractmethod
    def new_graphs(self, kv: Tensor, max_batch_size: int) -> Any:
        """Uncaptured DecodeGraphs of this backend's model on `kv`."""

    def capture_graphs(
        self,
        kv: Tensor,
        max_batch_size: int = DEFAULT_MAX_GRAPH_BATCH,
        budget_s: float = DEFAULT_GRAPH_BUDGET_S,
    ) -> None:
        """Capture decode CUDA graphs for batches up to max_batch_size on this pool. A
        rank of a tensor-parallel group captures every bucket, whatever the time: a
        budget that ran out on one rank and not on another would leave one rank's warm-up
        collectives waiting for ranks that stopped (each bucket's collectives are
        captured too, so every rank replays the same graphs)."""
        if not self.use_cuda_graphs:
            return
        self.check_pool(kv)
        graphs = self.new_graphs(kv, max_batch_size)
        graphs.capture(math.inf if self.tp.enabled else budget_s)
        self.graphs = graphs

    def probe_graphs(self, kv: Tensor, max_batch_size: int) -> object | None:
        """The largest decode batch's graph alone, captured on `kv` (memory_profile.py)."""
        if not self.use_cuda_graphs:
            return None
        self.check_pool(kv)
        graphs = self.new_graphs(kv, max_batch_size)
        graphs.capture(sizes=[max(graphs.sizes)])
        probe: object = graphs
        return probe

    def replay(self, batch: ForwardBatch, kv: Tensor) -> Tensor | None:
        """Logits [n, V] of a pure decode step from its graph (captured on this pool's
        first decode step if need be), or None when the step cannot replay one."""
        if not self.use_cuda_graphs or batch.num_seqs == 0 or batch.num_tokens != batch.num_seqs:
            return None
        if self.graphs is None or self.graphs.kv.data_ptr() != kv.data_ptr():
            self.capture_graphs(kv)
        if self.graphs is None or not self.graphs.can_run(batch, kv):
            return None
        with torch.inference_mode():
            logits: Tensor = self.graphs.run(batch)
        return logits
