"""The interface every model backend implements.

A backend owns the model weights of one engine process and runs one `ForwardBatch`
(forward_batch.py) per engine step: it writes the new tokens' K/V into the paged KV pool
and returns logits for the rows that are sampled. The pool is one tensor, block-major
(docs/architecture.md §5):

    kv: [num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]

Backends: `torch` (any Hugging Face causal LM through transformers' modules, CPU and
CUDA) and `turbo` (engine/turbo/: Llama family, Triton kernels and CUDA graphs, CUDA
only); `fake` computes nothing. `backends.select_backend` picks one; this module knows
none of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.kv_layout import QUANT_KV_DTYPES, bytes_per_block
from lmd.engine.parallel import SINGLE, TensorParallel

if TYPE_CHECKING:
    from lmd.engine.torch_backend.cpu_turns import CpuTurns

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class BackendError(ValueError):
    """A backend cannot be chosen or built as asked; the message says why in one line."""


class Backend(ABC):
    """A model loaded for one engine process; built as `cls(model_dir, device, dtype)`.

    `model_dir` is a local Hugging Face directory (see model_source.resolve_model).
    """

    name: ClassVar[str]

    @abstractmethod
    def __init__(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        *,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Load the model in `model_dir` onto `device` in `dtype`, its linear weights
        quantized at load with `quantization` (None: as the checkpoint has them), for a
        KV pool in `kv_cache_dtype` (engine/config.py); a backend that cannot run either
        raises BackendError saying so (`refuse_quantization`). With `tp` of size N > 1
        it loads rank tp.rank's shard (parallel.py): its properties then say what this
        rank holds (num_kv_heads: its heads) but `vocab_size`, whose logits it gathers."""

    @property
    @abstractmethod
    def architecture(self) -> str:
        """The model class name from config.json, e.g. "LlamaForCausalLM"."""

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @property
    @abstractmethod
    def num_kv_heads(self) -> int: ...

    @property
    @abstractmethod
    def head_dim(self) -> int: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Width of the returned logits."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a sequence (generation_config, else config)."""

    @property
    @abstractmethod
    def max_position_embeddings(self) -> int: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """Dtype of the weights and of the KV pool this backend reads and writes."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    def kv_cache_dtype(self) -> str:
        """The KV pool's element type this backend reads and writes: "auto" (`dtype`),
        "int8" or "fp8" (a quantized pool, kv_pool.py)."""
        return "auto"

    @property
    def quantization(self) -> str | None:
        """What of the weights runs quantized, as status and /v1/models show it (e.g.
        "w4a16 (awq, group 128)"); None when nothing does."""
        return None

    @property
    def tp(self) -> TensorParallel:
        """This rank's place in its tensor-parallel group (SINGLE: the whole model)."""
        return SINGLE

    @property
    def kv_window(self) -> int:
        """The sliding window when every layer has one (the engine frees KV blocks that
        fall behind it), else 0."""
        return 0

    @abstractmethod
    def forward(self, batch: ForwardBatch, kv: Tensor) -> Tensor:
        """Run one step: write the new tokens' K/V into `kv`, return float32 logits
        [len(batch.logits_indices), vocab_size], one row per entry of logits_indices."""

    def forward_eager(self, batch: ForwardBatch, kv: Tensor) -> Tensor:
        """`forward` for a one-off pass over a pool other than the engine's (the pipeline's
        get_ppl and logits outputs): uses and replaces nothing prepared for the engine's
        own pool (turbo overrides it to bypass its CUDA graphs)."""
        return self.forward(batch, kv)

    def forward_hidden(self, batch: ForwardBatch, kv: Tensor) -> tuple[Tensor, Tensor]:
        """`forward_eager`, also returning the last hidden states of the same rows (the
        output embedding's input): (logits [R, V] float32, hidden [R, hidden_size])."""
        raise BackendError(
            f"the {self.name} backend does not return hidden states; use the torch backend"
        )

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the block-major KV pool this backend expects."""
        return (num_blocks, self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)

    def check_pool(self, kv: Tensor) -> None:
        """ValueError unless `kv` is a pool this model can read and write: its shape,
        dtype and device type, one contiguous tensor (a quantized pool's values: each
        block contiguous, its scales after them)."""
        expected = self.kv_cache_shape(kv.shape[0], kv.shape[3])
        kind = self.kv_cache_dtype
        dtype = self.dtype if kind == "auto" else QUANT_KV_DTYPES[kind]
        if tuple(kv.shape) != expected or kv.dtype != dtype:
            raise ValueError(
                f"KV pool is {tuple(kv.shape)} {kv.dtype}, this model needs {expected} {dtype}"
            )
        if kv.device.type != self.device.type:
            raise ValueError(f"KV pool is on {kv.device}, the model on {self.device}")
        _, layers, _, slots, heads, dim = expected
        block = bytes_per_block(layers, heads, dim, slots, self.dtype, kv_cache_dtype=kind)
        if kv[0].is_contiguous() and kv.stride(0) * kv.element_size() == block:
            return
        raise ValueError("the KV pool must be one block-major allocation")

    def check_step(self, batch: ForwardBatch, kv: Tensor) -> None:
        """ValueError for a pool this model cannot use (check_pool) or a step that would
        reach outside it: a block id past the pool, a slot outside it, a block table
        shorter than its context. Out of range, a kernel reads or writes outside the pool
        (on CUDA a device assert kills the process), so this runs before any does, while
        the batch's tables are still on the CPU (in numpy: it runs every step)."""
        self.check_pool(kv)
        if batch.block_tables.device.type != "cpu" or batch.slot_mapping.device.type != "cpu":
            return
        num_blocks, block_size = kv.shape[0], kv.shape[3]
        tables, slots = batch.block_tables.numpy(), batch.slot_mapping.numpy()
        if tables.size and int(tables.max()) >= num_blocks:
            raise ValueError(f"block id {int(tables.max())} is outside the pool of {num_blocks}")
        if slots.size:
            low, high = int(slots.min()), int(slots.max())
            if low < 0 or high >= num_blocks * block_size:
                raise ValueError(f"slot {high if low >= 0 else low} is outside the KV pool")
        context = batch.context_lens.numpy()
        if context.size and -(-int(context.max()) // block_size) > tables.shape[1]:
            raise ValueError("a block table is shorter than its sequence's context")

    def adopt_pool(self, kv: Tensor) -> None:
        """`kv` is the engine's own pool (not a scratch one): a tensor-parallel group's
        other ranks make theirs (group_backend.py); nothing by default."""
        del kv

    def take_turns(self, turns: CpuTurns) -> None:
        """Disaggregated on a CPU: forwards in turn with the other role's engines of the
        node (torch_backend/cpu_turns.py). Nothing by default (a tensor-parallel group
        shares the cores evenly)."""
        del turns

    def capture_graphs(self, kv: Tensor, max_batch_size: int) -> None:
        """Prepare decode steps of up to `max_batch_size` sequences on this pool ahead of
        time (turbo: CUDA graphs); nothing by default."""
        del kv, max_batch_size

    def probe_graphs(self, kv: Tensor, max_batch_size: int) -> object | None:
        """What `capture_graphs` would hold for its largest batch, captured on `kv` (a
        scratch pool) for the memory profile to measure; the caller drops it. None by
        default (no graphs)."""
        del kv, max_batch_size
        return None


def refuse_parallel(backend: str, tp: TensorParallel) -> None:
    """BackendError for a backend that runs only whole models asked for a shard."""
    if tp.enabled:
        raise BackendError(
            f"backend {backend} has no tensor parallelism; use backend torch or turbo"
        )


def refuse_quantization(
    backend: str, quantization: str | None, kv_cache_dtype: str, *, kv: bool = False
) -> None:
    """BackendError for what a backend without quantized kernels was asked to run;
    `kv`: it never reads the pool, so any KV dtype will do."""
    if quantization is not None:
        raise BackendError(
            f"backend {backend} cannot quantize weights ({quantization}); use backend turbo"
        )
    if kv_cache_dtype != "auto" and not kv:
        raise BackendError(
            f"backend {backend} has no {kv_cache_dtype} KV cache; use backend turbo or "
            "kv_cache_dtype auto"
        )


def parse_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" = bfloat16 on CUDA (float16 where bf16 is unsupported), float32 on CPU."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise BackendError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def mm_has_float_output(like: Tensor) -> bool:
    """Whether torch.mm can multiply half-precision matrices like `like` into float32 here
    (cuBLAS can; torch exposes it as `out_dtype` on CUDA since 2.8). Both backends take
    their logits that way: cuBLAS accumulates in float32 anyway, and rounding logits to
    bf16 alone flips the greedy choice at ~1% of a random model's tokens."""
    if like.dtype == torch.float32 or like.device.type != "cuda":
        return False
    a = torch.ones(2, 2, dtype=like.dtype, device=like.device)
    try:
        return bool(torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32)
    except (TypeError, RuntimeError):
        return False
