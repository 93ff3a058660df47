"""A checkpoint's tensors by name: whole, or a tensor-parallel rank's part of each.

`CheckpointReader` reads every *.safetensors file of a model directory. Given a `Shard`
(a rank of a group, engine/parallel.py) it reads that rank's rows or columns of each
tensor straight from the file (`get_slice`), never the whole tensor, so the loaders
(weights.py, quant/load.py) need not know about the split. The split is Megatron's, as
the torch backend makes it (torch_backend/parallel.py), by tensor name:

- q, k, v (weights and biases): this rank's heads' rows (q heads, KV heads, x head_dim);
- o: those heads' input columns; its bias is whole (rank 0 adds it to the group's sum);
- gate, up (dense or each expert's; Mixtral's w1, w3): this rank's part of the width's
  rows; down (w2): the same input columns, its bias whole like o's;
- experts stacked as transformers 5 keeps them: gate_up_proj [E, 2I, hidden] this
  rank's part of each half, down_proj [E, hidden, I] its columns;
- embedding and output head: this rank's vocabulary rows (TensorParallel.vocab_part);
- everything else whole: norms (q_norm, k_norm are over one head's dim), routers.

A quantized checkpoint's tensors split along the same outputs or inputs, in the units
they are stored in (`_packed_split`): AWQ's and GPTQ's words of 8 nibbles, their groups
of G inputs (scales, zero points), FP8's 128 x 128 scale blocks; a part that does not
fall on those units' edges is refused in one line.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from lmd.engine.parallel import TensorParallel
from lmd.engine.turbo.config import TurboConfig, UnsupportedModel
from lmd.engine.turbo.quant.scheme import QuantScheme

# Projections split by output rows (column-parallel) and by input columns (row-parallel),
# by the name of their module, and in units of what.
HEADS, KV, WIDTH = "attention heads", "KV heads", "intermediate_size"
ROWS = {
    "q_proj": HEADS,
    "k_proj": KV,
    "v_proj": KV,
    "gate_proj": WIDTH,
    "up_proj": WIDTH,
    "w1": WIDTH,  # Mixtral's gate
    "w3": WIDTH,  # and up
}
COLUMNS = {"o_proj": HEADS, "down_proj": WIDTH, "w2": WIDTH}
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class Split:
    """A rank's part of a tensor: the slices `parts` of dimension `dim` (concatenated
    along it), which the whole model has `full` long."""

    dim: int
    parts: tuple[slice, ...]
    full: int

    def index(self, part: slice) -> tuple[slice, ...]:
        """The index of one part, e.g. [:, a:b] for dim 1."""
        return (slice(None),) * self.dim + (part,)


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank tp.rank's view of the checkpoint of `config` (the whole model's), quantized
    as `scheme` reads it."""

    config: TurboConfig
    tp: TensorParallel
    scheme: QuantScheme | None = None

    def split(self, name: str) -> Split | None:
        """How this rank reads tensor `name`; None: whole (or no group)."""
        if not self.tp.enabled:
            return None
        c = self.config
        if name in VOCAB:
            return Split(0, (self.tp.vocab_part(c.vocab_size),), c.vocab_size)
        *path, module, param = name.split(".")
        moe = c.moe if "experts" in path or module == "experts" else None
        width = c.intermediate_size if moe is None else moe.intermediate_size
        if module == "experts" and param in ("gate_up_proj", "down_proj"):
            # Stacked experts: gate_up_proj [E, 2I, hidden] (each half), down_proj [E, hidden, I].
            part = self.tp.part(width, "the experts' intermediate_size")
            if param == "down_proj":
                return Split(2, (part,), width)
            upper = slice(width + part.start, width + part.stop)
            return Split(1, (part, upper), 2 * width)
        # What the projection splits: (units, rows or columns per unit).
        units = {
            HEADS: (c.num_heads, c.head_dim),
            KV: (c.num_kv_heads, c.head_dim),
            WIDTH: (width, 1),
        }
        if module in ROWS:
            dim, unit = 0, ROWS[module]
        elif module in COLUMNS and param != "bias":  # a bias of o or down stays whole
            dim, unit = 1, COLUMNS[module]
        else:
            return None
        count, size = units[unit]
        part = self.tp.part(count, unit)
        mine = slice(part.start * size, part.stop * size)
        if param in ("weight", "bias"):
            return Split(dim, (mine,), count * size)
        return self._packed_split(name, param, outputs=dim == 0, part=mine, full=count * size)

    def _packed_split(
        self, name: str, param: str, *, outputs: bool, part: slice, full: int
    ) -> Split | None:
        """A quantized tensor's split: the [part] of the layer's outputs (`outputs`) or
        inputs, in the units of `param`'s layout (quant/w4a16_checkpoint.py, fp8.py)."""
        scheme = self.scheme
        if scheme is None:
            return None
        source, group = scheme.source, scheme.group_size
        # The outputs or inputs a step of the split dimension holds, and that dimension;
        # None: the tensor is read whole.
        layouts: dict[str, tuple[int, int] | None] = {
            "weight_scale": (1, 0) if outputs else None,  # FP8 per output channel: [N]
            "weight_scale_inv": (128, 0 if outputs else 1),  # [N / 128, K / 128] blocks
            "scales": (1, 1) if outputs else (group, 0),  # [K / G, N]
            "qzeros": (8, 1) if outputs else (group, 0),  # [K / G, N / 8]
            # GPTQ [K / 8, N] (along K), AWQ [K, N / 8] (along N)
            "qweight": ((1, 1) if outputs else (8, 0))
            if source == "gptq"
            else ((8, 1) if outputs else (1, 0)),
            "g_idx": None if outputs else (1, 0),  # [K]
        }
        layout = layouts.get(param)
        if layout is None:
            return None
        unit, dim = layout
        last = part.stop == full  # the last part may end in a partial FP8 block
        if part.start % unit or (part.stop % unit and not (last and unit == 128)):
            raise UnsupportedModel(
                f"{name}: rank {self.tp.rank}'s part {part.start}:{part.stop} of {full} "
                f"{'outputs' if outputs else 'inputs'} does not fall on its steps of {unit}"
            )
        return Split(dim, (slice(part.start // unit, -(-part.stop // unit)),), -(-full // unit))


class CheckpointReader:
    """Tensors by name over every *.safetensors file of a directory (sharded or not),
    each whole or, with `shard`, that rank's part of it."""

    def __init__(
        self, model_dir: Path, device: torch.device, stack: ExitStack, shard: Shard | None = None
    ) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise UnsupportedModel(f"{model_dir} has no *.safetensors weights")
        # Load straight onto the GPU where there is one (no second host copy).
        where = str(device) if device.type == "cuda" else "cpu"
        self._where: dict[str, Any] = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device=where))
            for name in handle.keys():  # noqa: SIM118  # a safetensors handle, not a dict
                self._where[name] = handle
        self.model_dir = model_dir
        self.shard = shard

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def splits(self, name: str) -> bool:
        """Whether `get` reads only this rank's part of tensor `name`."""
        return self.shard is not None and self.shard.split(name) is not None

    def get(self, name: str, dtype: torch.dtype | None, device: torch.device) -> Tensor:
        """The tensor `name` (this rank's part of it) on `device`, in `dtype` (None: as
        stored)."""
        handle = self._where.get(name)
        if handle is None:
            raise UnsupportedModel(f"{self.model_dir} has no tensor {name}")
        split = None if self.shard is None else self.shard.split(name)
        tensor: Tensor = handle.get_tensor(name) if split is None else _read(handle, name, split)
        return tensor.to(device=device, dtype=dtype or tensor.dtype)


def _read(handle: Any, name: str, split: Split) -> Tensor:
    """The parts `split` names of a tensor, read alone; the whole tensor's length along
    the split is checked first (a part of a wrong tensor could look right)."""
    view = handle.get_slice(name)
    shape = tuple(view.get_shape())
    if len(shape) <= split.dim or shape[split.dim] != split.full:
        raise UnsupportedModel(
            f"{name} is {shape}, the config says {split.full} along dimension {split.dim}"
        )
    parts = [view[split.index(part)] for part in split.parts]
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=split.dim)
    return tensor.contiguous()
