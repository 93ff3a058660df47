"""`TurboBackend`: the turbo decoder behind the engine's `Backend` interface.

Built as `TurboBackend(model_dir, device, dtype)` on CUDA. A pure decode step (one new
token per sequence, every row sampled) replays a CUDA graph; graphs are captured for a
KV pool the first time a decode step runs on it, or up front with `capture_graphs`
(which the engine should call once the pool exists, so that capture is start-up time).
Prefill chunks and mixed batches run eagerly. The pool layout and dtype are the torch
backend's, so either backend can continue what the other started. With `tp` (a rank of
a tensor-parallel group, engine/parallel.py) it loads and runs that rank's shard: its
config (`config`) has the rank's heads and widths, its pool the rank's KV heads, and
every rank's forward returns the whole vocabulary's logits.

Importing this module imports triton: `backends.select_backend` checks that it can first. On
CPU the backend builds only with Triton's interpreter switched on (TRITON_INTERPRET=1):
a test path that runs the same kernels slowly, without graphs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from lmd.engine.backend import BackendError
from lmd.engine.config import read_hf_config
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.graphed import GraphedDecode
from lmd.engine.parallel import SINGLE, ParallelError, TensorParallel
from lmd.engine.turbo import kernels
from lmd.engine.turbo.config import TurboConfig, UnsupportedModel
from lmd.engine.turbo.exchange import PeerExchange
from lmd.engine.turbo.graphs import DecodeGraphs
from lmd.engine.turbo.model import TurboModel
from lmd.engine.turbo.quant.fp8 import fp8_supported
from lmd.engine.turbo.quant.scheme import quantized_experts, read_scheme
from lmd.engine.turbo.rope import layer_rope_tables
from lmd.engine.turbo.step_inputs import StepInputs
from lmd.engine.turbo.weights import eos_token_ids, load_weights

log = logging.getLogger(__name__)


class TurboBackend(GraphedDecode):
    name: ClassVar[str] = "turbo"

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
    ) -> None:
        self._tp = tp
        self._device = torch.device(device)
        self._dtype = dtype
        if self._device.type != "cuda" and not (
            self._device.type == "cpu" and kernels.interpreting()
        ):
            raise BackendError(f"backend turbo needs CUDA, not {self._device.type}")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise BackendError(f"backend turbo runs bfloat16, float16 or float32, not {dtype}")
        try:
            whole = TurboConfig.load(model_dir)
            self.scheme = read_scheme(read_hf_config(model_dir), quantization)
        except UnsupportedModel as exc:
            raise BackendError(f"backend turbo cannot serve {model_dir}: {exc}") from None
        try:
            self.config = whole.for_rank(tp)  # this rank's heads and widths
        except ParallelError as exc:
            raise BackendError(
                f"backend turbo cannot split {model_dir} over {tp.size} ranks: {exc}"
            ) from None
        self._kv_cache_dtype = kv_cache_dtype
        fp8 = []
        if self.scheme is not None and self.scheme.method == "fp8":
            fp8.append(f"weights {self.scheme.describe()}")
        if kv_cache_dtype == "fp8" and not kernels.interpreting():
            fp8.append("an fp8 KV cache")
        if fp8 and (reason := fp8_supported(self._device)) is not None:
            raise BackendError(f"backend turbo cannot run {' and '.join(fp8)}: {reason}")
        start = time.perf_counter()
        try:
            weights = load_weights(model_dir, whole, self._device, dtype, self.scheme, tp=tp)
        except UnsupportedModel as exc:
            raise BackendError(f"backend turbo cannot load {model_dir}: {exc}") from None
        ropes = layer_rope_tables(model_dir, self.config.max_position_embeddings, self._device)
        self.model = TurboModel(self.config, weights, ropes, tp)
        if self.model.exchange_fits():  # the same on every rank: a collective call
            width = self.config.hidden_size
            points = 2 * self.config.num_layers
            self.model.exchange = PeerExchange.create(points, width, dtype, self._device)
        self._eos = eos_token_ids(model_dir)
        self.use_cuda_graphs = cuda_graphs and self._device.type == "cuda"
        self.graphs: DecodeGraphs | None = None
        self._num_sms = (
            torch.cuda.get_device_properties(self._device).multi_processor_count
            if self._device.type == "cuda"
            else 4
        )
        log.info(
            "turbo backend: %s from %s on %s (%s%s%s%s), %.2f GiB of weights in %.1f s",
            self.config.architecture,
            model_dir,
            self._device,
            dtype,
            f", weights {self.quantization}" if self.scheme else "",
            f", KV {kv_cache_dtype}" if kv_cache_dtype != "auto" else "",
            f", rank {tp.rank} of {tp.size}" if tp.enabled else "",
            weights.nbytes / 2**30,
            time.perf_counter() - start,
        )

    # Backend properties ----------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return self.config.architecture

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_kv_heads(self) -> int:
        """This rank's KV heads (all of them without tensor parallelism)."""
        return self.config.num_kv_heads

    @property
    def tp(self) -> TensorParallel:
        return self._tp

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def kv_cache_dtype(self) -> str:
        return self._kv_cache_dtype

    @property
    def quantization(self) -> str | None:
        if self.scheme is None:
            return None
        sixteen = self.config.moe is not None and not quantized_experts(self.scheme, self.config)
        experts = "; experts 16-bit" if sixteen else ""  # e.g. act order: dequantized at load
        return f"{self.scheme.describe()}{experts}"

    @property
    def kv_window(self) -> int:
        windows = self.config.windows
        return min(windows) if windows and all(windows) else 0

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    # Stepping --------------------------------------------------------------------------

    def new_graphs(self, kv: Tensor, max_batch_size: int) -> DecodeGraphs:
        return DecodeGraphs(self.model, kv, max_batch_size)

    def forward(self, batch: ForwardBatch, kv: Tensor) -> Tensor:
        self.check_step(batch, kv)
        num_rows = int(batch.logits_indices.shape[0])
        if batch.num_tokens == 0:
            return torch.empty(num_rows, self.vocab_size, device=self._device)
        logits = self.replay(batch, kv)
        return self.forward_eager(batch, kv) if logits is None else logits

    def forward_eager(self, batch: ForwardBatch, kv: Tensor) -> Tensor:
        """The same step without CUDA graphs."""
        step = StepInputs.from_batch(batch, self._device, self.num_kv_heads, self._num_sms)
        with torch.inference_mode():
            return self.model.forward(step, kv)
