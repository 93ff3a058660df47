"""The interface every model backend implements, and the batch it runs.

A backend owns the model weights of one engine process and runs one `ForwardBatch` per
engine step: it writes the new tokens' K/V into the paged KV pool and returns logits for
the rows that are sampled. The pool is one tensor, block-major (docs/architecture.md §5):

    kv: [num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]

Backends: `torch` (any Hugging Face causal LM through transformers' modules, CPU and
CUDA) and `turbo` (engine/turbo/: Llama family, Triton kernels and CUDA graphs, CUDA
only); `fake` computes nothing. `backends.select_backend` picks one; this module knows
none of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from lmd.engine.kv_layout import QUANT_KV_DTYPES, bytes_per_block
from lmd.engine.parallel import SINGLE, TensorParallel

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


@dataclass(slots=True)
class ForwardBatch:
    """One engine step: the new tokens of B sequences packed into T rows, no padding.

    Sequences may mix prefill chunks (many new tokens, maybe after a cached prefix) and
    decode steps (one new token). Sequence b owns rows `cu_seqlens[b]:cu_seqlens[b+1]`;
    its new tokens sit at positions `num_cached[b] .. context_lens[b]-1`, and the K/V of
    all `context_lens[b]` tokens lives in the blocks `block_tables[b]` lists in order
    (token p in block `block_tables[b, p // block_size]` at offset `p % block_size`).
    Build it with `ForwardBatch.pack`; `seq_lens` and `context_lens` stay on the CPU
    (the backend reads them without a device sync), the rest is copied to the device.
    `input_ids` may already be on the device: a decode step the engine runs ahead feeds
    the previous step's sampled tokens from where they are.
    """

    input_ids: Tensor  # [T] int64, new tokens, sequence after sequence (CPU or device)
    positions: Tensor  # [T] int64, position of each token in its sequence
    seq_lens: Tensor  # [B] int32 on CPU, new tokens per sequence (>= 1)
    context_lens: Tensor  # [B] int32 on CPU, cached + new tokens after this step
    block_tables: Tensor  # [B, max_blocks] int32, block ids, -1 padded
    slot_mapping: Tensor  # [T] int64, block_id * block_size + offset of each new token
    logits_indices: Tensor  # [R] int64, rows of T whose logits forward returns

    def __post_init__(self) -> None:
        t, b = self.input_ids.shape[0], self.seq_lens.shape[0]
        if self.input_ids.ndim != 1 or self.positions.shape != (t,):
            raise ValueError("input_ids and positions must both be [T]")
        if self.slot_mapping.shape != (t,):
            raise ValueError("slot_mapping must be [T], one slot per new token")
        if self.context_lens.shape != (b,) or self.block_tables.ndim != 2:
            raise ValueError("context_lens must be [B] and block_tables [B, max_blocks]")
        if self.block_tables.shape[0] != b or self.block_tables.dtype != torch.int32:
            raise ValueError("block_tables must be int32 with one row per sequence")
        if self.seq_lens.device.type != "cpu" or self.context_lens.device.type != "cpu":
            raise ValueError("seq_lens and context_lens must stay on the CPU")
        # numpy views of the CPU tensors: a torch op on the host costs far more than a numpy
        # one (docs/benchmarks.md, 'Run 2: measured').
        seq_lens, context_lens = self.seq_lens.numpy(), self.context_lens.numpy()
        if int(seq_lens.sum()) != t or (b and int(seq_lens.min()) < 1):
            raise ValueError("seq_lens must be >= 1 and sum to the number of tokens")
        if bool((context_lens < seq_lens).any()):
            raise ValueError("context_lens must count the new tokens too (>= seq_lens)")
        if self.positions.device.type == "cpu" and not np.array_equal(
            self.positions.numpy(), _positions(seq_lens, context_lens - seq_lens)
        ):
            raise ValueError("positions must run from num_cached to context_lens - 1")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def cu_seqlens(self) -> Tensor:
        """[B + 1] int32 on CPU: sequence b's rows are cu_seqlens[b]:cu_seqlens[b+1]."""
        out = torch.zeros(self.num_seqs + 1, dtype=torch.int32)
        torch.cumsum(self.seq_lens, 0, out=out[1:])
        return out

    @property
    def num_cached(self) -> Tensor:
        """[B] int32 on CPU: tokens already in the KV pool before this step."""
        return self.context_lens - self.seq_lens

    @classmethod
    def pack(
        cls,
        new_token_ids: Sequence[Sequence[int]],
        num_cached: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        sample: Sequence[bool] | None = None,
    ) -> ForwardBatch:
        """Pack B sequences' new tokens into one batch (CPU tensors).

        new_token_ids[b]: the tokens to run now (a prompt chunk, or the one last token);
        num_cached[b]: tokens of sequence b whose K/V is already in its blocks (a cached
        prefix or earlier chunks); block_tables[b]: its block ids, covering at least
        num_cached[b] + len(new_token_ids[b]) tokens; sample[b]: whether forward returns
        logits for its last token (False for a prompt chunk that is not the last; default
        all True).
        """
        b = len(new_token_ids)
        if not len(num_cached) == len(block_tables) == b or (
            sample is not None and len(sample) != b
        ):
            raise ValueError("pack needs one entry per sequence in every argument")
        # numpy, then zero-copy tensors: a torch op on the host costs far more than a numpy
        # one, and this runs every step (with torch ops it took a large share of a batch-1
        # step: docs/benchmarks.md, 'Where an engine decode step goes').
        seq_lens = np.fromiter(map(len, new_token_ids), dtype=np.int64, count=b)
        cached = np.asarray(num_cached, dtype=np.int64).reshape(b)
        context_lens = cached + seq_lens
        num_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=b)
        width = max(1, int(num_blocks.max(initial=1)))
        flat = np.fromiter(chain.from_iterable(block_tables), dtype=np.int64)
        if flat.size and int(flat.min()) < 0:
            raise ValueError("block ids must be >= 0")
        short = np.flatnonzero(num_blocks * block_size < context_lens)
        if short.size:
            i = int(short[0])
            raise ValueError(
                f"sequence {i}: {num_blocks[i]} blocks of {block_size} cannot hold "
                f"{context_lens[i]} tokens"
            )
        tables = np.full((b, width), -1, dtype=np.int32)
        tables[np.arange(width) < num_blocks[:, None]] = flat
        num_rows = int(seq_lens.sum())
        input_ids = np.fromiter(chain.from_iterable(new_token_ids), dtype=np.int64, count=num_rows)
        seq_of_row = np.repeat(np.arange(b), seq_lens)  # [T]
        positions = _positions(seq_lens, cached)
        blocks = tables[seq_of_row, positions // block_size].astype(np.int64)
        slot_mapping = blocks * block_size + positions % block_size
        last_rows = np.cumsum(seq_lens) - 1
        logits_indices = last_rows if sample is None else last_rows[np.asarray(sample, dtype=bool)]
        return cls(
            torch.from_numpy(input_ids),
            torch.from_numpy(positions),
            torch.from_numpy(seq_lens.astype(np.int32)),
            torch.from_numpy(context_lens.astype(np.int32)),
            torch.from_numpy(tables),
            torch.from_numpy(slot_mapping),
            torch.from_numpy(np.ascontiguousarray(logits_indices)),
        )


def _positions(seq_lens: NDArray[Any], num_cached: NDArray[Any]) -> NDArray[np.int64]:
    """[T] int64: num_cached[b], num_cached[b] + 1, ... for each sequence's new tokens."""
    lens = seq_lens.astype(np.int64)
    seq_of_row = np.repeat(np.arange(lens.shape[0]), lens)  # [T]
    starts = np.cumsum(lens) - lens  # [B], first row of each sequence
    return np.arange(int(lens.sum())) - starts[seq_of_row] + num_cached.astype(np.int64)[seq_of_row]


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
