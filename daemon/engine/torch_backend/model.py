"""The torch backend: any Hugging Face causal LM, run by transformers' own modules.

The model is loaded from a local directory with `AutoModelForCausalLM` (never the hub)
and switched to our paged attention (`attention.py`) through transformers' attention
interface. A step runs the packed batch as one sequence of T tokens with explicit
position ids, so there is no padding, no HF KV cache object (use_cache=False) and no
mask tensor (transformers makes none for an implementation without a mask function);
rotary embeddings come from the position ids. On CUDA, pure decode steps replay CUDA
graphs where the model allows them (graphs.py); prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lmd.engine.backend import BackendError, refuse_quantization
from lmd.engine.config import checkpoint_quant_method, context_len, read_hf_config
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.graphed import GraphedDecode
from lmd.engine.parallel import SINGLE, ParallelError, TensorParallel
from lmd.engine.torch_backend import native_cpu
from lmd.engine.torch_backend.attention import (
    ATTENTION_NAME,
    METADATA_KWARG,
    PagedMetadata,
    paged_attention,
)
from lmd.engine.torch_backend.cpu_threads import CpuThreads
from lmd.engine.torch_backend.cpu_turns import CpuTurns
from lmd.engine.torch_backend.graphs import GraphModel, GraphShape, why_not
from lmd.engine.torch_backend.host_memory import keep_freed_memory
from lmd.engine.torch_backend.linear import can_pack, pack_linears
from lmd.engine.torch_backend.logits import float_logits
from lmd.engine.torch_backend.norm import fuse_rms_norms
from lmd.engine.torch_backend.parallel import check_host_memory, split_model

log = logging.getLogger(__name__)

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


class TorchBackend(GraphedDecode):
    """A Hugging Face causal LM on CPU or CUDA with paged attention."""

    name: ClassVar[str] = "torch"

    def __init__(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        *,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        tp: TensorParallel = SINGLE,
        cuda_graphs: bool = True,
        cpu_matmul_dtype: str = "auto",
    ) -> None:
        refuse_quantization(self.name, quantization, kv_cache_dtype)
        self._tp = tp
        if (method := checkpoint_quant_method(model_dir)) is not None:
            raise BackendError(
                f"backend torch does not load {method} checkpoints ({model_dir}); use turbo"
            )
        self._device = torch.device(device)
        self._dtype = dtype
        # CPU: reuse freed activations; only as many threads as other processes leave cores.
        self._threads: CpuThreads | None = None
        if self._device.type == "cpu":
            keep_freed_memory()
            self._threads = CpuThreads()
        config = _load_config(model_dir)
        self._config = config.get_text_config()
        self._context_len = context_len(read_hf_config(model_dir))
        layer_types = getattr(self._config, "layer_types", None) or []
        others = sorted(set(layer_types) - ATTENTION_LAYER_TYPES)
        if others:
            raise BackendError(
                f"model {model_dir} has {', '.join(others)} layers: the torch backend "
                "serves attention-only models"
            )
        AttentionInterface.register(ATTENTION_NAME, paged_attention)
        if tp.enabled:
            try:
                check_host_memory(model_dir, tp, dtype)
            except ParallelError as exc:
                raise BackendError(f"tensor parallelism {tp.size}: {exc}") from None
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=dtype,
            attn_implementation=ATTENTION_NAME,
            local_files_only=True,
        )
        # is_backend_compatible is unannotated in transformers.
        if not type(model).is_backend_compatible():  # type: ignore[no-untyped-call]
            raise BackendError(
                f"{type(model).__name__} does not route attention through transformers' "
                "attention interface, so the torch backend cannot page its KV cache"
            )
        if tp.enabled:  # split on the host, before the shard goes to the device
            try:
                split_model(model, tp)
            except ParallelError as exc:
                raise BackendError(f"tensor parallelism {tp.size}: {exc}") from None
        # PreTrainedModel.to is wrapped by a decorator whose typing mypy misreads.
        model = model.to(self._device)  # type: ignore[arg-type]
        self.model: PreTrainedModel = model.eval().requires_grad_(False)
        if can_pack(self._device, dtype):  # fp32 on CPU: see linear.py and norm.py
            bf16 = cpu_matmul_dtype == "bfloat16" or (
                cpu_matmul_dtype == "auto" and native_cpu.has_bf16_dot()
            )
            pack_linears(self.model, bf16)
            fuse_rms_norms(self.model)
        float_logits(self.model)  # half precision on CUDA: see logits.py
        self._architecture = type(model).__name__
        log.info(
            "torch backend: %s from %s on %s (%s)%s",
            self._architecture,
            model_dir,
            device,
            dtype,
            f", rank {tp.rank} of {tp.size}" if tp.enabled else "",
        )
        self.graphs: Any = None  # turbo's DecodeGraphs, once captured
        self.use_cuda_graphs = False
        if cuda_graphs and self._device.type == "cuda":
            reason = why_not(self._config)
            self.use_cuda_graphs = reason is None
            if reason is not None:
                log.info("torch backend: decode steps run without CUDA graphs: %s", reason)

    @property
    def architecture(self) -> str:
        return self._architecture

    @property
    def num_layers(self) -> int:
        return int(self._config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        """This rank's KV heads (all of them without tensor parallelism)."""
        heads = getattr(self._config, "num_key_value_heads", None)
        total = int(heads if heads is not None else self._config.num_attention_heads)
        return total // self._tp.size

    @property
    def tp(self) -> TensorParallel:
        return self._tp

    @property
    def head_dim(self) -> int:
        dim = getattr(self._config, "head_dim", None)
        if dim is not None:
            return int(dim)
        return int(self._config.hidden_size // self._config.num_attention_heads)

    @property
    def vocab_size(self) -> int:
        return int(self._config.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        generation = getattr(self.model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        if eos is None:
            eos = getattr(self._config, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(int(t) for t in eos) if isinstance(eos, list | tuple) else (int(eos),)

    @property
    def max_position_embeddings(self) -> int:
        return self._context_len

    @property
    def kv_window(self) -> int:
        """Every layer windowed: Mistral's and Mixtral's `sliding_window`, or a
        `layer_types` of sliding layers only."""
        window = int(getattr(self._config, "sliding_window", None) or 0)
        types = getattr(self._config, "layer_types", None)
        if types:
            return window if all(t == "sliding_attention" for t in types) else 0
        return window if self._config.model_type in ("mistral", "mixtral") else 0

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def new_graphs(self, kv: Tensor, max_batch_size: int) -> Any:
        from lmd.engine.turbo.graphs import DecodeGraphs

        shape = GraphShape(self._context_len, self.vocab_size, self.num_kv_heads)
        model = GraphModel(self.model, shape, self.num_layers, self._tp)
        return DecodeGraphs(model, kv, max_batch_size, name="torch backend")

    def forward(self, batch: ForwardBatch, kv: Tensor) -> Tensor:
        self.check_step(batch, kv)
        logits = self.replay(batch, kv)
        return self._forward_eager(batch, kv) if logits is None else logits

    def forward_eager(self, batch: ForwardBatch, kv: Tensor) -> Tensor:
        """The same step without CUDA graphs."""
        self.check_step(batch, kv)
        return self._forward_eager(batch, kv)

    def _forward_eager(self, batch: ForwardBatch, kv: Tensor) -> Tensor:
        num_rows = int(batch.logits_indices.shape[0])
        if batch.num_tokens == 0:
            return torch.empty(num_rows, self.vocab_size, device=self._device)
        if self._threads is not None:
            self._threads.update()
        meta = PagedMetadata.build(batch, kv)
        extra: dict[str, Any] = {METADATA_KWARG: meta}
        turn = self._threads.turns if self._threads is not None else None
        with torch.inference_mode(), turn.forward() if turn is not None else nullcontext():
            out = self.model(
                input_ids=batch.input_ids.to(self._device, non_blocking=True)[None],  # [1, T]
                position_ids=meta.positions[None],  # [1, T]
                use_cache=False,
                logits_to_keep=batch.logits_indices.to(self._device, non_blocking=True),
                **extra,
            )
        if meta.num_layers_run != self.num_layers:
            raise RuntimeError(
                f"{self._architecture} ran {meta.num_layers_run} of {self.num_layers} "
                "attention layers through the paged attention: its KV cache would be wrong"
            )
        logits: Tensor = out.logits[0]  # [R, V] (a rank of a group: [R, its vocabulary rows])
        return self._tp.gather_columns(logits.float(), self.vocab_size)

    def take_turns(self, turns: CpuTurns) -> None:
        if self._threads is not None:  # on a CPU
            self._threads.turns = turns

    def forward_hidden(self, batch: ForwardBatch, kv: Tensor) -> tuple[Tensor, Tensor]:
        # The output embedding's input, caught on its way in: one pass, whatever the model
        # does after it (soft-capping, scaling) stays in the logits.
        caught: list[Tensor] = []
        head = self.model.get_output_embeddings()  # type: ignore[no-untyped-call]
        hook = head.register_forward_pre_hook(lambda _m, args: caught.append(args[0]))
        try:
            logits = self.forward_eager(batch, kv)  # a graph's replay would call no hook
        finally:
            hook.remove()
        if not caught:  # an empty batch runs no model
            return logits, torch.empty(0, int(self._config.hidden_size), device=self._device)
        return logits, caught[0].reshape(-1, caught[0].shape[-1])  # [R, hidden]


def _load_config(model_dir: Path) -> Any:
    """The model's config, with a one-line error for a directory transformers rejects."""
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise BackendError(f"cannot load the config of {model_dir}: {first_line}") from exc
