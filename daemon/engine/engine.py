"""The engine: schedulers, a backend, the sampler and one KV pool, stepped in-process.

Life cycle of a request in the engine (hybrid: prefill and decode in one process):
  1. `add(seq)` queues it for prefill (the prompt is checked against the length limit).
  2. `step()` runs a prefill step when prompts are waiting and the decode batch has
     room (chunks of several prompts packed up to max_prefill_token_num); a prompt whose
     last chunk ran samples its first token and joins the decode batch. Otherwise it runs
     one decode step over the running batch; sequences preempted for lack of blocks go
     back to the front of the prefill queue to be recomputed. With prompts waiting while
     sequences decode (EngineConfig.mixed_prefill_tokens; on by default on a CPU), one
     forward runs both: the decode rows, then prompt chunks (see _step_mixed).
  3. Every token sampled comes back as a `TokenEvent` with the finish reason, if any.
  4. `abort(request_id)` frees the request's blocks wherever it is.
The worker that owns an engine calls `step()` from one thread only. With a sliding window
on every layer (`backend.kv_window`), blocks behind it are freed while decoding.

Overlapped decode steps (`EngineConfig.overlap_steps`, on by default on CUDA): inflight.py.

Disaggregated roles run the same engine: a `prefill` engine hands each sequence whose
prompt completed (and did not finish at its first token) to `take_prefilled()` instead
of decoding it, for the worker to migrate; a `decode` engine takes migrated sequences
through `add_prefilled(seq)` and recomputes preempted ones itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmd.engine.backend import Backend
from lmd.engine.backends import load_backend
from lmd.engine.block_manager import BlockManager
from lmd.engine.config import MIXED_PREFILL_TOKENS, EngineConfig
from lmd.engine.decode_scheduler import DecodeBatch, DecodeScheduler
from lmd.engine.events import TokenEvent
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.group_backend import OpLink
from lmd.engine.inflight import InFlight
from lmd.engine.kv_pool import KVPool, PoolBuffer, block_bytes_of, size_pool
from lmd.engine.memory_plan import Budget, StepOutOfMemory, describe
from lmd.engine.memory_profile import cap_allocator, forward_retrying, size_in_budget
from lmd.engine.parallel import SINGLE, TensorParallel
from lmd.engine.prefill_scheduler import PrefillBatch, PrefillScheduler
from lmd.engine.sampler import Sampler, TokenLogprobs
from lmd.engine.sequence import FinishReason, Sequence, check_token_ids
from lmd.protocol.roles import ENGINE_ROLES, Role

log = logging.getLogger(__name__)
MIX_HORIZON_STEPS = 8  # a mixed step takes at least 1/8 of the queued prompt tokens


class Engine:
    def __init__(
        self, backend: Backend, config: EngineConfig, pool: KVPool, *, role: Role = Role.HYBRID
    ) -> None:
        if role not in ENGINE_ROLES:
            raise ValueError(f"engine role {role!r} is not one of {', '.join(ENGINE_ROLES)}")
        self.role = Role(role)
        self.backend = backend
        self.config = config.with_session_len(backend.max_position_embeddings)
        self.pool = pool
        eos = backend.eos_token_ids
        caching, window = self.config.enable_prefix_caching, backend.kv_window
        self.block_manager = BlockManager(
            pool.num_blocks, pool.block_size, enable_prefix_caching=caching, window=window
        )
        self.prefill = PrefillScheduler(self.config, self.block_manager, eos)
        self.decode = DecodeScheduler(self.config, self.block_manager, eos)
        self.sampler = Sampler(eos)
        self.num_steps = 0
        self._prefilled: list[Sequence] = []  # prefill role: prompts done, to migrate
        overlap = self.config.overlap_steps
        self.overlap = backend.device.type == "cuda" if overlap is None else overlap
        self.num_ahead_steps = 0  # decode steps launched before the last one was read
        self.num_mixed_steps = 0  # forwards that ran decode rows and prompt chunks
        self._inflight: InFlight | None = None
        self._free_later: list[Sequence] = []  # finished while a step was in flight
        self.memory: dict[str, Any] | None = None  # the memory plan's part (CUDA), bytes
        self._stepping: list[Sequence] = []  # the sequences of the step being run
        # Prompt chunks in decode steps (hybrid: a prefill role has no decode rows, a decode
        # role no prompts). Unset: on a CPU only (docs/benchmarks.md, "Mixed steps").
        mixed, on_cpu = self.config.mixed_prefill_tokens, backend.device.type != "cuda"
        mixed = (MIXED_PREFILL_TOKENS if on_cpu else 0) if mixed is None else mixed
        self.mixed_prefill_tokens = mixed if self.role == Role.HYBRID else 0

    @classmethod
    def build(
        cls,
        model_dir: Path,
        config: EngineConfig,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        backend: str = "auto",
        role: Role = Role.HYBRID,
        pool_buffer: Callable[[int], PoolBuffer | None] | None = None,
        cpu_engines: int = 1,
        cpu_free: int | None = None,
        budget: Budget | None = None,
        tp: TensorParallel = SINGLE,
        ranks: OpLink | None = None,
    ) -> Engine:
        """Load the model, size and allocate the KV pool.

        `pool_buffer(nbytes)`, when given, provides the pool's memory (a migration
        transport's shared region); otherwise the pool allocates its own. On CUDA, the
        pool is sized inside `budget`, the engine's part of the device (memory_profile.py).
        On CPU, `cpu_free` is the bytes this engine may treat as free (kv_pool.cpu_kv_free);
        None: an even share of `cpu_engines` of the available RAM. With `tp`: rank 0 of a
        tensor-parallel group, its other `ranks` (backends.load_backend)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is not None:
            # Kernels (Triton's included) and graph captures use the current device.
            torch.cuda.set_device(dev)
        planned = budget if dev.type == "cuda" else None
        if planned is not None:
            cap_allocator(planned, dev)
        model = load_backend(backend, model_dir, dev, dtype, config, tp=tp, ranks=ranks)
        per_block = block_bytes_of(model, config.block_size)
        memory: dict[str, Any] | None = None
        if planned is not None:
            resolved = config.with_session_len(model.max_position_embeddings)
            num_blocks, memory = size_in_budget(model, resolved, role, planned, per_block)
        else:
            num_blocks = size_pool(model, config, cpu_engines, cpu_free)
        buffer = None if pool_buffer is None else pool_buffer(num_blocks * per_block)
        pool = KVPool.for_backend(model, num_blocks, config.block_size, buffer)
        model.adopt_pool(pool.kv)
        mib = pool.nbytes / 2**20
        log.info("KV pool: %d blocks of %d tokens (%.1f MiB)", num_blocks, config.block_size, mib)
        if role != Role.PREFILL:  # a prefill engine runs no decode step
            model.capture_graphs(pool.kv, config.max_batch_size)
        engine = cls(model, config, pool, role=role)
        if memory is not None:
            engine.memory = memory
            log.info("memory plan: %s", describe(memory))
        return engine

    # Requests --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a request; raises ValueError saying what is wrong: a token id outside the
        vocabulary, or a prompt over the length limit (naming it)."""
        check_token_ids(seq, self.backend.vocab_size)
        self.prefill.add(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """Decode a sequence whose prompt KV is already in its blocks (migrated here)."""
        self.decode.add(seq)

    def take_prefilled(self) -> list[Sequence]:
        """Prefill role: the sequences whose prompt completed since the last call.

        Each holds its blocks until the worker frees them (after migrating them).
        """
        out, self._prefilled = self._prefilled, []
        return out

    def abort(self, request_id: str) -> Sequence | None:
        if self._inflight is not None:
            self._inflight.wait()  # its kernels may still write into the blocks freed here
        return self.prefill.abort(request_id) or self.decode.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self._inflight is not None or self.prefill.has_work or self.decode.has_work

    @property
    def num_running(self) -> int:
        return self.prefill.num_running + self.decode.num_running

    @property
    def num_waiting(self) -> int:
        return self.prefill.num_waiting + self.decode.num_waiting

    def stats(self) -> dict[str, Any]:
        """What status shows for an engine worker."""
        return {
            "kv": {
                "total_blocks": self.block_manager.num_total_blocks,
                "free_blocks": self.block_manager.num_free_blocks,
                "block_size": self.config.block_size,
            },
            "running": self.num_running,
            "waiting": self.num_waiting,
            "queued_tokens": self.prefill.num_queued_tokens,
        }

    # Stepping --------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """Run one prefill or decode step; returns the tokens sampled since the last call.

        With a decode step in flight: launch the next one ahead if it can, then return the
        one in flight's tokens (without a step ahead, a step of its own follows).
        """
        self.num_steps += 1
        self._stepping = []
        try:
            return self._step_once()
        except torch.OutOfMemoryError as exc:
            detail = str(exc).splitlines()[0] if str(exc) else ""
        raise StepOutOfMemory(self._drop_failed_step(), detail) from None

    def _drop_failed_step(self) -> list[str]:
        """After an allocation failed in a step (called out of its handler, so the step's
        tensors are freed first): abort its and the in-flight step's requests; their ids."""
        seqs = self._stepping
        if self._inflight is not None:
            self._inflight.wait()
            seqs = [*seqs, *self._inflight.batch.seqs]
            self._inflight = None
        for seq in self._free_later:
            self.block_manager.free(seq)
        self._free_later = []
        failed = list(dict.fromkeys(s.request_id for s in seqs if not s.is_finished))
        for request_id in failed:
            if self.prefill.abort(request_id) is None:
                self.decode.abort(request_id)
        if self.backend.device.type == "cuda":
            torch.cuda.empty_cache()  # whole segments back: the cache was in pieces
        return failed

    def _step_once(self) -> list[TokenEvent]:
        inflight = self._inflight
        if inflight is None:
            return self._step()
        ahead = self._schedule_ahead()
        if ahead is None:
            self._inflight = None
            return self._read_back(inflight, pending=False) + self._step()
        logits, seqs = self._forward_ahead(ahead, inflight), ahead.seqs
        if not any(s.sampling.needs_history for s in seqs):
            self._inflight = InFlight.launch(ahead, self.sampler.sample(logits, seqs, ahead=1))
            return self._read_back(inflight, pending=True)
        # A row needs the token in flight (a penalty, a grammar): read it back meanwhile.
        self._inflight = None  # read back: an allocation failing below drops `seqs` alone
        events = self._read_back(inflight, pending=True)
        self._inflight = InFlight.launch(ahead, self.sampler.sample(logits, seqs))
        return events

    @property
    def _free_slots(self) -> int:
        """Decode batch places neither running, waiting nor being prefilled."""
        return self.config.max_batch_size - self.decode.num_seqs - self.prefill.num_running

    def _step(self) -> list[TokenEvent]:
        free_slots = self._free_slots
        if self.role == Role.PREFILL:  # nothing decodes here: the batch is prefill's own
            free_slots = self.config.max_batch_size - self.prefill.num_running
        prompts = self.prefill.num_waiting or self.prefill.num_running
        # Mixed while decode leaves room for prompt tokens in a step's rows.
        decoding = 0 < self.decode.num_seqs < self.config.max_prefill_token_num
        if prompts and self.mixed_prefill_tokens and decoding:
            return self._step_mixed(max(0, free_slots))
        if prompts:
            batch = self.prefill.schedule(max_new_seqs=max(0, free_slots))
            if not batch.is_empty:
                return self._run_prefill(batch)
        dec = self._schedule_decode()
        if dec.is_empty:
            return []
        return self._run_decode(dec)

    def _schedule_decode(self) -> DecodeBatch:
        dec = self.decode.schedule()
        for seq in dec.preempted:
            self.prefill.add(seq, front=True)
        return dec

    def _step_mixed(self, free_slots: int) -> list[TokenEvent]:
        """Prompts to prefill while sequences decode (hybrid): the decode rows, then prompt
        chunks, in one forward that reads the weights once. The chunks take
        mixed_prefill_tokens, or an eighth of the prompt tokens queued when more (a burst
        is taken in a few steps, none stalling decoding for all of it), up to
        max_prefill_token_num rows with the decode rows."""
        dec = self._schedule_decode()
        queued = self.prefill.num_queued_tokens
        wanted = max(self.mixed_prefill_tokens, -(-queued // MIX_HORIZON_STEPS))
        budget = min(wanted, self.config.max_prefill_token_num - len(dec.seqs))
        batch = self.prefill.schedule(max_new_seqs=free_slots, budget=budget)
        if not batch.is_empty:
            return self._run_prefill(batch, dec)
        return [] if dec.is_empty else self._run_decode(dec)

    def _run_prefill(self, batch: PrefillBatch, dec: DecodeBatch | None = None) -> list[TokenEvent]:
        """A prefill step; with `dec`, its decode rows run first in the same forward."""
        seqs, chunks = dec.seqs if dec is not None else [], batch.chunks
        self._stepping = [*seqs, *(c.seq for c in chunks)]
        forward = ForwardBatch.pack(
            [*([s.last_token_id] for s in seqs), *(c.token_ids for c in chunks)],
            [*(s.num_tokens - 1 for s in seqs), *(c.start for c in chunks)],
            [*(s.block_table for s in seqs), *(c.seq.block_table for c in chunks)],
            self.pool.block_size,
            sample=[*(True for _ in seqs), *(c.is_last for c in chunks)],
        )
        to_sample = [*seqs, *batch.seqs_to_sample]
        token_ids, logprobs = self._sample(forward, to_sample)
        if dec is not None:
            self.num_mixed_steps += 1
            self.decode.postprocess(dec, token_ids[: len(seqs)])
        for seq in self.prefill.postprocess(batch, token_ids[len(seqs) :]):
            if seq.is_finished:
                continue
            if self.role == Role.PREFILL:
                self._prefilled.append(seq)
            else:
                self.decode.add(seq)
        return self._events(to_sample, token_ids, logprobs)

    def _run_decode(self, batch: DecodeBatch) -> list[TokenEvent]:
        seqs = self._stepping = batch.seqs
        forward = ForwardBatch.pack(
            [[s.last_token_id] for s in seqs],
            [s.num_tokens - 1 for s in seqs],
            [s.block_table for s in seqs],
            self.pool.block_size,
        )
        if self.overlap:
            logits = forward_retrying(self.backend, forward, self.pool.kv)  # [B, V]
            self._inflight = InFlight.launch(batch, self.sampler.sample(logits, seqs))
            return []  # read back by the next step() call
        token_ids, logprobs = self._sample(forward, seqs)
        self.decode.postprocess(batch, token_ids)
        return self._events(seqs, token_ids, logprobs)

    def _schedule_ahead(self) -> DecodeBatch | None:
        """Step N+1 if it can run before step N's tokens are known (see the module doc)."""
        if self.prefill.num_running or (self.prefill.num_waiting and self._free_slots > 0):
            return None  # a prompt is to be prefilled next
        return self.decode.schedule_ahead()

    def _forward_ahead(self, batch: DecodeBatch, last: InFlight) -> torch.Tensor:
        """Launch `batch`'s forward, each sequence feeding the token `last` sampled for
        it; its logits ([B, V], on the device)."""
        seqs = self._stepping = batch.seqs
        tokens = last.tokens
        # `seqs` are `last`'s in order, less any finished or aborted since (none join).
        if len(seqs) < len(last.batch.seqs):
            row = {id(s): i for i, s in enumerate(last.batch.seqs)}
            index = torch.tensor([row[id(s)] for s in seqs])
            tokens = tokens.index_select(0, index.to(tokens.device, non_blocking=True))
        forward = ForwardBatch.pack(
            [[0]] * len(seqs),  # placeholders: the ids are on the device (below)
            [s.num_tokens for s in seqs],  # the pending token's position
            [s.block_table for s in seqs],
            self.pool.block_size,
        )
        forward.input_ids = tokens
        self.num_ahead_steps += 1
        return forward_retrying(self.backend, forward, self.pool.kv)

    def _read_back(self, inflight: InFlight, *, pending: bool) -> list[TokenEvent]:
        """Wait for `inflight`, append its tokens and return their events; `pending`: a
        step launched since holds the blocks of the sequences that finish here."""
        inflight.wait()  # every step launched before it is done too
        for seq in self._free_later:
            self.block_manager.free(seq)
        self._free_later = []
        token_ids, logprobs = inflight.host.tolist()
        seqs = inflight.batch.seqs
        # Sequences that finished (or were aborted) before this step's tokens came back:
        # their rows ran ahead for nothing.
        live = [i for i, seq in enumerate(seqs) if not seq.is_finished]
        finished = self.decode.postprocess(inflight.batch, token_ids, free=not pending)
        if pending:
            self._free_later.extend(finished)
        if len(live) < len(seqs):
            seqs = [seqs[i] for i in live]
            token_ids, logprobs = [token_ids[i] for i in live], [logprobs[i] for i in live]
        return self._events(seqs, token_ids, logprobs)

    def _sample(
        self, forward: ForwardBatch, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        logits = forward_retrying(self.backend, forward, self.pool.kv)  # [R, V]
        if not seqs:
            return [], []
        return self.sampler.sample(logits, seqs).tolist()

    @staticmethod
    def _events(
        seqs: list[Sequence], token_ids: list[int], logprobs: list[TokenLogprobs | None]
    ) -> list[TokenEvent]:
        return [
            TokenEvent(
                seq.request_id,
                tok,
                lp,
                seq.finish_reason,
                min(seq.num_prefix_cached_tokens, len(seq.prompt_token_ids)),
                len(seq.output_token_ids) - 1,
            )
            for seq, tok, lp in zip(seqs, token_ids, logprobs, strict=True)
            if seq.finish_reason != FinishReason.ABORT
        ]
