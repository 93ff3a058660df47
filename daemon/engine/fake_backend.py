"""FakeBackend: the Backend interface with no model behind it.

It reads the model's config.json for its facts (layers, heads, vocabulary, EOS), so the
KV pool, the schedulers, the sampler and every process around them work as with a real
model, but `forward` computes nothing: the next token after token t is a fixed function
of t (never an EOS id), and the KV pool is left untouched. Used by tests of the engine's
bookkeeping and by `lmd-bench front`, which measures the serving path (api, tokenizer,
engine loop, wire) without the model's cost. Its text is meaningless.

The logits live in one buffer that each forward rewrites (as a CUDA-graph backend's output
buffer would): a step only touches the entries it sets, instead of allocating and zeroing
[R, V], which was a large share of a fake decode step at batch 64 with a 49k vocabulary
(docs/benchmarks.md, 'Figures that code comments used to quote'). They are valid until
the next forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from lmd.engine.backend import Backend, refuse_parallel, refuse_quantization
from lmd.engine.config import context_len, read_hf_config
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.parallel import SINGLE, TensorParallel


class FakeBackend(Backend):
    name: ClassVar[str] = "fake"

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
        refuse_parallel(self.name, tp)
        # It reads no KV, so a quantized pool is as good as any (tests of its migration).
        refuse_quantization(self.name, quantization, kv_cache_dtype, kv=True)
        self._kv_cache_dtype = kv_cache_dtype
        config: dict[str, Any] = read_hf_config(model_dir)
        config = config.get("text_config", config)
        self._config = config
        self._device = torch.device(device)
        self._dtype = dtype
        eos = config.get("eos_token_id")
        self._eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        self._logits = torch.zeros(0, self.vocab_size, device=self._device)  # [capacity, V]
        self._ones: tuple[Tensor, Tensor] | None = None  # (rows, cols) set to 1 last time

    @property
    def architecture(self) -> str:
        archs = self._config.get("architectures") or ["unknown"]
        return str(archs[0])

    @property
    def kv_cache_dtype(self) -> str:
        return self._kv_cache_dtype

    @property
    def num_layers(self) -> int:
        return int(self._config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        heads = self._config.get("num_key_value_heads") or self._config["num_attention_heads"]
        return int(heads)

    @property
    def head_dim(self) -> int:
        dim = self._config.get("head_dim")
        return int(dim or self._config["hidden_size"] // self._config["num_attention_heads"])

    @property
    def vocab_size(self) -> int:
        return int(self._config["vocab_size"])

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(int(t) for t in self._eos)

    @property
    def max_position_embeddings(self) -> int:
        return context_len(self._config)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def next_token(self, token: Tensor) -> Tensor:
        """The token that follows `token`: a fixed walk over the vocabulary, skipping EOS."""
        nxt = (token * 31 + 7) % self.vocab_size
        for eos in self._eos:
            nxt = torch.where(nxt == eos, (nxt + 1) % self.vocab_size, nxt)
        return nxt

    def next_token_id(self, token: int) -> int:
        """`next_token` for one Python int (the fixed-token engine's, per token)."""
        nxt = (token * 31 + 7) % self.vocab_size
        for eos in self._eos:
            if nxt == eos:
                nxt = (nxt + 1) % self.vocab_size
        return nxt

    def forward(self, batch: ForwardBatch, kv: Tensor) -> Tensor:
        rows = batch.logits_indices.to(self._device)
        last = batch.input_ids.to(self._device)[rows]  # [R]
        n = len(rows)
        if n > self._logits.shape[0]:
            capacity = max(n, 2 * self._logits.shape[0])
            self._logits = torch.zeros(capacity, self.vocab_size, device=self._device)
        elif self._ones is not None:
            self._logits[self._ones] = 0.0  # back to all zeros
        self._ones = (torch.arange(n, device=self._device), self.next_token(last))
        self._logits[self._ones] = 1.0
        return self._logits[:n]  # [R, V]
