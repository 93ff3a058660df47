"""A Hugging Face model split for tensor parallelism (engine/parallel.py), in place.

transformers publishes, per architecture, which linears split how (`base_model_tp_plan`
on the config class: "colwise", "rowwise", ...); this follows that plan with our own
collectives instead of transformers' DTensor path, so that the model's own forward runs
unchanged on each rank's shard:

- colwise (q/k/v, gate/up): a Linear keeps this rank's output rows (its heads, its part
  of the MLP's width) and its bias's; nothing to sum.
- rowwise (o, down): a Linear keeps this rank's input columns; its output is summed over
  the group (`RowParallel`), the bias added once, after the sum.
- a layer of experts (Mixtral, Qwen3-MoE: "packed_colwise" gate|up, "rowwise" down,
  "moe_tp_experts" for the layer): each expert keeps this rank's part of its width; the
  layer's output is summed (`SummedOutput`); the router stays whole.
- replicated (q_norm, k_norm: a norm over each head's dim) stays as it is.
- the embedding keeps this rank's vocabulary rows (`VocabParallelEmbedding`: ids of
  other ranks look up a zero row, the rows are summed), the output head likewise; the
  backend gathers the logits of every rank's rows (TensorParallel.gather_columns).
Anything else in a plan (sequence parallel, expert parallel) is refused with its name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, cast

import psutil
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lmd.engine.memory_needs import weight_bytes
from lmd.engine.parallel import ParallelError, TensorParallel

COLWISE = {"colwise", "colwise_rep", "local_colwise"}
ROWWISE = {"rowwise", "rowwise_rep", "local_rowwise"}
REPLICATED = {"replicated_with_grad_allreduce", "local"}
EXPERT_PARTS = {"packed_colwise"}  # the experts' stacked gate|up
EXPERT_LAYER = {"moe_tp_experts"}


class RowParallel(nn.Module):
    """A Linear holding this rank's input columns: y = sum over ranks (x_r @ W_r^T) + b."""

    def __init__(self, linear: nn.Linear, tp: TensorParallel) -> None:
        super().__init__()
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        linear.register_parameter("bias", None)
        self.linear = linear  # the shard itself; the CPU path packs it (linear.py)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.tp.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias

    @property
    def weight(self) -> Tensor:  # read by models that check dtypes
        weight: Tensor = self.linear.weight
        return weight


class SummedOutput(nn.Module):
    """A module whose output is a partial sum on each rank (a layer of split experts)."""

    def __init__(self, module: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.module = module
        self.tp = tp

    def forward(self, *args: object, **kwargs: object) -> Tensor:
        out: Tensor = self.module(*args, **kwargs)
        return self.tp.all_reduce(out)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # the layer's own attributes (num_experts, ...)
            return getattr(self.module, name)


class VocabParallelEmbedding(nn.Module):
    """An embedding holding this rank's vocabulary rows; the looked-up rows are summed
    over the group (each id's row lives on one rank, the others add zeros). The wrapped
    module's own forward runs (Gemma's scaled embedding scales its rows)."""

    def __init__(self, embedding: nn.Embedding, tp: TensorParallel) -> None:
        super().__init__()
        part = tp.vocab_part(embedding.num_embeddings)
        self.start, self.end = part.start, part.stop
        weight = embedding.weight.detach()[part]
        if weight.shape[0] == 0:  # a last rank with no rows: one zero row to look up
            weight = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        embedding.weight = nn.Parameter(weight.clone(), requires_grad=False)
        embedding.num_embeddings = weight.shape[0]
        embedding.padding_idx = None
        self.embedding = embedding
        self.tp = tp

    def forward(self, input_ids: Tensor) -> Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, 0)
        rows: Tensor = self.embedding(local)
        rows = rows * mine.unsqueeze(-1).to(rows.dtype)
        return self.tp.all_reduce(rows)

    @property
    def weight(self) -> Tensor:
        weight: Tensor = self.embedding.weight
        return weight


def tp_plan(model: PreTrainedModel) -> dict[str, str]:
    """The split transformers publishes for the model's decoder (its config's
    base_model_tp_plan): module path pattern -> style."""
    config = model.config.get_text_config()
    plan = getattr(config, "base_model_tp_plan", None) or getattr(
        type(config), "base_model_tp_plan", None
    )
    return dict(plan or {})


def _pattern(path: str) -> re.Pattern[str]:
    return re.compile(re.escape(path).replace(r"\*", r"\d+") + "$")


def split_model(model: PreTrainedModel, tp: TensorParallel) -> None:
    """Split `model` (a transformers causal LM, weights loaded) for rank tp.rank of
    tp.size, in place; ParallelError names what cannot be split."""
    arch = type(model).__name__
    plan = tp_plan(model)
    if not plan:
        raise ParallelError(f"{arch} publishes no tensor-parallel plan (base_model_tp_plan)")
    config = model.config.get_text_config()
    heads = int(config.num_attention_heads)
    tp.part(heads, "attention heads")  # a head is never split: its rows go together
    tp.part(int(getattr(config, "num_key_value_heads", None) or heads), "KV heads")
    base = cast(PreTrainedModel, model.base_model)
    patterns = [(_pattern(path), style) for path, style in plan.items()]
    # Deepest paths first: a layer of experts is wrapped after its parts are split.
    targets: list[tuple[str, str]] = []
    for name, _module in base.named_modules():
        for pattern, style in patterns:
            if pattern.match(name):
                targets.append((name, style))
    params = {
        name: style
        for name, _param in base.named_parameters()
        for pattern, style in patterns
        if pattern.match(name)
    }
    embed = base.get_input_embeddings()
    for name, style in sorted(targets, key=lambda t: -t[0].count(".")):
        module = base.get_submodule(name)
        if module is embed:
            continue  # split below, whatever style the plan names (embedding_rowwise)
        if style in COLWISE and isinstance(module, nn.Linear):
            _keep_rows(module, tp, f"{name} (out features)")
        elif style in ROWWISE and isinstance(module, nn.Linear):
            _keep_columns(module, tp, f"{name} (in features)")
            base.set_submodule(name, RowParallel(module, tp))
        elif style in EXPERT_LAYER:
            _split_experts(module, params, name, tp)
            base.set_submodule(name, SummedOutput(module, tp))
        elif style in REPLICATED or name in params:
            continue  # kept whole; experts' parameters are split with their layer
        else:
            raise ParallelError(
                f"{arch}: {name} ({style}, {type(module).__name__}) cannot be split for "
                "tensor parallelism by the torch backend"
            )
    if not isinstance(embed, nn.Embedding):
        raise ParallelError(f"{arch}: its embedding is not an nn.Embedding")
    head: Any = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    tied = head is not None and head.weight is embed.weight
    parallel_embed = VocabParallelEmbedding(embed, tp)
    base.set_input_embeddings(parallel_embed)
    if not isinstance(head, nn.Linear) or getattr(head, "bias", None) is not None:
        raise ParallelError(f"{arch}: its output head is not a Linear without bias")
    part = tp.vocab_part(head.out_features)
    if tied:
        head.weight = parallel_embed.embedding.weight
    else:
        head.weight = nn.Parameter(head.weight.detach()[part].clone(), requires_grad=False)
    head.out_features = head.weight.shape[0]


def _keep_rows(linear: nn.Linear, tp: TensorParallel, what: str) -> None:
    part = tp.part(linear.out_features, what)
    linear.weight = nn.Parameter(linear.weight.detach()[part].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[part].clone(), requires_grad=False)
    linear.out_features = part.stop - part.start


def _keep_columns(linear: nn.Linear, tp: TensorParallel, what: str) -> None:
    part = tp.part(linear.in_features, what)
    linear.weight = nn.Parameter(linear.weight.detach()[:, part].clone(), requires_grad=False)
    linear.in_features = part.stop - part.start


def _split_experts(
    module: nn.Module, params: dict[str, str], layer: str, tp: TensorParallel
) -> None:
    """A layer of experts as transformers 5 stacks them: gate_up_proj [E, 2I, H] keeps
    this rank's part of each half, down_proj [E, H, I] the same columns."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        raise ParallelError(f"{layer}: experts without stacked gate_up_proj and down_proj")
    if getattr(module, "gate_up_proj_bias", None) is not None:
        raise ParallelError(f"{layer}: experts with biases cannot be split")
    width = down.shape[-1]
    part = tp.part(width, f"{layer} (expert width)")
    rows = torch.cat(
        [torch.arange(width)[part], width + torch.arange(width)[part]]
    )  # this rank's gate rows, then its up rows
    module.gate_up_proj = nn.Parameter(gate_up.detach()[:, rows].clone(), requires_grad=False)
    module.down_proj = nn.Parameter(down.detach()[:, :, part].clone(), requires_grad=False)
    if hasattr(module, "intermediate_dim"):
        module.intermediate_dim = part.stop - part.start
    for name in (f"{layer}.gate_up_proj", f"{layer}.down_proj"):
        params.pop(name, None)


def check_host_memory(model_dir: Path, tp: TensorParallel, dtype: torch.dtype) -> None:
    """ParallelError when the group's ranks cannot each hold the whole model (as `dtype`)
    in host memory at once: transformers loads all of it in every rank, which then keeps
    its part (two ranks of a 138 GB model on a 256 GiB host were killed by the kernel's
    OOM killer, again at every restart). turbo's ranks read only their part."""
    weights = weight_bytes(model_dir, dtype)
    available = psutil.virtual_memory().available
    if weights * tp.size > available:
        raise ParallelError(
            f"its {tp.size} ranks each load the whole checkpoint ({weights / 2**30:.1f} GiB) "
            f"into host memory, {weights * tp.size / 2**30:.1f} GiB in all, and the host has "
            f"{available / 2**30:.1f} GiB available; use backend turbo, whose ranks read "
            "only their part"
        )
