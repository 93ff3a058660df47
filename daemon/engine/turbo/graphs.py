"""CUDA graphs of the decode step, one per batch-size bucket, captured for one KV pool.

Life cycle:
  1. `DecodeGraphs(model, kv, max_batch_size)` allocates static input buffers sized for
     the largest bucket and an output buffer of float32 logits.
  2. `capture(budget_s)` captures the buckets largest first (they share one memory pool,
     so the smaller ones reuse the largest one's activations), each after one eager run
     that compiles its Triton kernels; it logs progress and stops at the time budget
     (buckets left out run eagerly).
  3. `run(batch)` copies a decode batch of n sequences into the buffers of the smallest
     captured bucket >= n, marks the rows past n as padding (no slot: nothing written;
     context 0: attention reads nothing), replays, and returns the first n logits rows.
     Token ids already on the device (a step the engine runs ahead) are copied there,
     device to device, without waiting for them on the host.
The attention splits of a bucket are fixed at capture (for the longest context the
block tables can hold); each split's share of a sequence is computed on the GPU from
its context length, so short contexts cost little.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.turbo import kernels
from lmd.engine.turbo.step_inputs import StepInputs

log = logging.getLogger(__name__)

# A padding row's inputs (token id, position, slot, context length), as a column.
PADDING = np.array([[0], [0], [-1], [0]], dtype=np.int32)


def bucket_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 128, every 32 to 256, every 64 beyond,
    up to and including max_batch_size: padding stays under ~25% above batch 8."""
    sizes = [1, 2, 4]
    size = 8
    while size < max_batch_size:
        sizes.append(size)
        size += 8 if size < 64 else 16 if size < 128 else 32 if size < 256 else 64
    sizes.append(max_batch_size)
    return sorted({s for s in sizes if s <= max_batch_size})


class GraphedConfig(Protocol):
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...


class GraphedModel(Protocol):
    """What a graph captures: turbo's TurboModel, or the torch backend's GraphModel."""

    @property
    def config(self) -> GraphedConfig: ...

    def forward(self, step: StepInputs, kv: Tensor, out: Tensor | None = None) -> Tensor: ...


class DecodeGraphs:
    def __init__(
        self, model: GraphedModel, kv: Tensor, max_batch_size: int, name: str = "turbo"
    ) -> None:
        if kv.device.type != "cuda":
            raise ValueError("CUDA graphs need the KV pool on a CUDA device")
        self.model = model
        self.name = name  # in the log lines
        self.kv = kv
        self.sizes = bucket_sizes(max_batch_size)
        device = kv.device
        block_size = kv.shape[3]
        self.max_blocks = math.ceil(model.config.max_position_embeddings / block_size)
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        n = self.sizes[-1]
        # Static inputs, int32: rows of one buffer (token ids, positions, slots, context
        # lengths), so that a step sends them with one copy, and the block tables.
        self._inputs = torch.zeros(4, n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.logits = torch.empty(n, model.config.vocab_size, dtype=torch.float32, device=device)
        # Their pinned host mirrors, filled through numpy views: a torch op on the host
        # costs far more than a numpy slice assignment (docs/benchmarks.md, 'Run 2:
        # measured', where torch ops on the mirrors made the step slower).
        self._host = torch.zeros(4, n, dtype=torch.int32, pin_memory=True)
        self._host_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=True)
        self._host_np = self._host.numpy()
        self._host_tables_np = self._host_tables.numpy()
        # Marks when the copies out of the host mirrors are done (Event is untyped).
        self._sent = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._every_row = np.arange(n)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0

    @property
    def input_ids(self) -> Tensor:
        return self._inputs[0]

    @property
    def positions(self) -> Tensor:
        return self._inputs[1]

    @property
    def slot_mapping(self) -> Tensor:
        return self._inputs[2]

    @property
    def context_lens(self) -> Tensor:
        return self._inputs[3]

    @property
    def max_batch_size(self) -> int:
        """The largest captured bucket (0 before capture)."""
        return max(self.graphs, default=0)

    def _step(self, size: int) -> StepInputs:
        max_context = self.max_blocks * self.kv.shape[3]
        return StepInputs(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            cu_seqlens=None,
            logits_indices=None,
            max_seq_len=1,
            num_splits=kernels.decode_splits(
                size, self.model.config.num_kv_heads, max_context, self.num_sms
            ),
        )

    def capture(self, budget_s: float = 60.0, sizes: list[int] | None = None) -> None:
        """Capture every bucket (or `sizes`), largest first, until `budget_s` seconds
        have passed."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Padding everywhere: the warm-up runs write nothing into the pool.
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        todo = sorted(self.sizes if sizes is None else sizes, reverse=True)
        log.info("%s: capturing %d decode CUDA graphs (batch %d..1)", self.name, len(todo), todo[0])
        with torch.inference_mode():
            for done, size in enumerate(todo, 1):
                if time.perf_counter() - start > budget_s:
                    log.warning(
                        "%s: CUDA graph budget of %.0f s spent; batches %s run eagerly",
                        self.name,
                        budget_s,
                        ", ".join(map(str, todo[done - 1 :])),
                    )
                    break
                step = self._step(size)
                self.model.forward(step, self.kv, out=self.logits[:size])  # compile, warm up
                torch.cuda.synchronize(self.kv.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.model.forward(step, self.kv, out=self.logits[:size])
                self.graphs[size] = graph
                if done == len(todo) or done % max(1, len(todo) // 4) == 0:
                    log.info(
                        "%s: captured %d/%d CUDA graphs (%.1f s)",
                        self.name,
                        done,
                        len(todo),
                        time.perf_counter() - start,
                    )
        torch.cuda.synchronize(self.kv.device)
        self.capture_seconds = time.perf_counter() - start

    def can_run(self, batch: ForwardBatch, kv: Tensor) -> bool:
        """A pure decode step of this pool that fits a captured bucket."""
        n = batch.num_seqs
        return (
            kv.data_ptr() == self.kv.data_ptr()
            and 0 < n <= self.max_batch_size
            and batch.num_tokens == n
            and batch.block_tables.shape[1] <= self.max_blocks
            and np.array_equal(_numpy(batch.logits_indices), self._every_row[:n])
        )

    def run(self, batch: ForwardBatch) -> Tensor:
        """Replay the bucket for this decode batch; returns logits [n, V] float32."""
        n = batch.num_seqs
        size = next(s for s in self.sizes if s >= n and s in self.graphs)
        width = batch.block_tables.shape[1]
        self._sent.synchronize()  # the last step's copies have left the host mirrors
        host = self._host_np
        on_device = batch.input_ids.device.type == "cuda"  # a step run ahead (engine.py)
        if not on_device:
            host[0, :n] = _numpy(batch.input_ids)
        host[1, :n] = _numpy(batch.positions)
        host[2, :n] = _numpy(batch.slot_mapping)
        host[3, :n] = _numpy(batch.context_lens)
        host[:, n:size] = PADDING  # rows past n: no slot to write, no context to read
        self._host_tables_np[:n, :width] = _numpy(batch.block_tables)
        self._inputs[:, :size].copy_(self._host[:, :size], non_blocking=True)
        self.block_tables[:size, :width].copy_(self._host_tables[:size, :width], non_blocking=True)
        if on_device:  # the previous step's tokens, behind it on the stream: no host wait
            self.input_ids[:n].copy_(batch.input_ids)
        self._sent.record()
        self.graphs[size].replay()
        # A copy: the static buffer is overwritten by the next replay.
        return self.logits[:n].clone()


def _numpy(t: Tensor) -> np.ndarray[Any, Any]:
    return (t if t.device.type == "cpu" else t.cpu()).numpy()
