"""CUDA graphs of the torch backend's decode step: transformers' modules, replayed.

A decode step of a Hugging Face model launches hundreds of small kernels from Python
(59 ms a batch-1 step on the Qwen3-8B shape before graphs, docs/benchmarks.md). Replayed
as a CUDA graph, the Python is gone. What a graph needs is a step whose shapes do not
depend on the batch's contexts, so the graphed step's attention is turbo's Triton
kernels (paged decode attention over block tables, a K/V write that skips padding
rows: attention.py `_graph_decode`) and the rest is the model's own forward; turbo's
`DecodeGraphs` captures buckets of batch sizes and replays them (turbo/graphs.py).

Graphs are used where they can be: on CUDA with triton importing, for models whose
forward has no data-dependent host work. Mixtures of experts in transformers pick their
experts with `nonzero()` (a host sync a graph cannot hold) and logit soft-capping has
no Triton path: those run eagerly, `why_not` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lmd.engine.parallel import SINGLE, TensorParallel
from lmd.engine.torch_backend.attention import METADATA_KWARG, PagedMetadata
from lmd.engine.turbo.support import triton_import_error


@dataclass(frozen=True, slots=True)
class GraphShape:
    """The sizes turbo's DecodeGraphs reads from a model's config."""

    max_position_embeddings: int
    vocab_size: int
    num_kv_heads: int


class GraphModel:
    """The transformers model as DecodeGraphs drives it: forward(step, kv, out)."""

    def __init__(
        self, model: nn.Module, shape: GraphShape, num_layers: int, tp: TensorParallel = SINGLE
    ) -> None:
        self.model = model
        self.config = shape
        self.num_layers = num_layers
        self.tp = tp  # a rank of a group gathers every rank's vocabulary rows

    def forward(self, step: Any, kv: Tensor, out: Tensor | None = None) -> Tensor:
        """Logits [B, V] float32 of a decode step (turbo's StepInputs, static buffers)."""
        meta = PagedMetadata.for_graph(step, kv)
        result = self.model(
            input_ids=step.input_ids[None],  # [1, B]
            position_ids=step.positions[None],  # [1, B]
            use_cache=False,
            **{METADATA_KWARG: meta},
        )
        if meta.num_layers_run != self.num_layers:
            raise RuntimeError(
                f"{type(self.model).__name__} ran {meta.num_layers_run} of {self.num_layers} "
                "attention layers through the paged attention"
            )
        logits = self.tp.gather_columns(result.logits[0].float(), self.config.vocab_size)  # [B, V]
        return logits if out is None else out.copy_(logits)


def why_not(config: Any) -> str | None:
    """Why this model's decode step cannot be a CUDA graph here, or None when it can."""
    if any(getattr(config, k, None) for k in ("num_local_experts", "num_experts")):
        return "its experts are chosen with a host sync (nonzero) in transformers"
    if getattr(config, "attn_logit_softcapping", None):
        return "logit soft-capping has no Triton decode attention"
    return triton_import_error()
