"""FixedTokenEngine: what an engine worker drives, with no engine behind it.

The front issue measures the api and the tokenizer "with a fake engine (a worker that
returns fixed tokens at once) through the real processes". The `fake` backend is not
that: it runs the real engine (schedulers, sampler, block manager) around a model that
computes nothing, which costs the engine process more CPU per streamed token than the api
on the 2-core CI machine (docs/benchmarks.md, 'The issue's fake engine: a worker that
returns fixed tokens'). `--decode-backend fixed` puts this class in the hybrid worker
instead; the worker around it (inbox, step thread, Tokens messages, heartbeats) is the
real one.

Life cycle of a request here:
  1. `add(seq)` checks the token ids and the prompt's length, as the engine does, and
     refuses logprobs (there is no distribution to report).
  2. Each `step()` gives every running request its next token at once: one token per
     request per step, as a decode step does, so the worker sends Tokens messages of a
     real engine's shape at the rate of an infinitely fast model. The token after t
     follows the fake backend's fixed walk over the vocabulary (never EOS); the
     request ends by the real rules of `Sequence.append_token` (max_tokens, stop token
     ids, the session length).
  3. `abort(request_id)` forgets it. Nothing holds KV blocks, so nothing can leak.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from lmd.engine.config import EngineConfig
from lmd.engine.events import TokenEvent
from lmd.engine.fake_backend import FakeBackend
from lmd.engine.sequence import FinishReason, Sequence, check_token_ids


class FixedTokens(FakeBackend):
    """The model facts and the token walk, under the name status shows."""

    name: ClassVar[str] = "fixed"

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir, torch.device("cpu"), torch.float32)


class FixedTokenEngine:
    def __init__(self, backend: FixedTokens, config: EngineConfig) -> None:
        self.backend = backend
        self.config = config.with_session_len(backend.max_position_embeddings)
        self.num_steps = 0
        self._running: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        """Start a request; ValueError says why one cannot run."""
        check_token_ids(seq, self.backend.vocab_size)
        limit = self.config.session_len
        if limit is not None and seq.num_tokens >= limit:
            raise ValueError(
                f"request {seq.request_id} has {seq.num_tokens} tokens; the limit is "
                f"{limit - 1} (session_len), leaving no room for output"
            )
        if seq.sampling.logprobs is not None:
            raise ValueError("the fixed-token engine (a benchmark fake) computes no logprobs")
        if seq.sampling.guided is not None:
            raise ValueError("the fixed-token engine (a benchmark fake) follows no grammar")
        self._running[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._running.pop(request_id, None)
        if seq is not None:
            seq.finish(FinishReason.ABORT)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self._running)

    def stats(self) -> dict[str, Any]:
        """No "kv": it holds none, and routing then sees no block limit."""
        return {"running": len(self._running), "waiting": 0, "queued_tokens": 0}

    def step(self) -> list[TokenEvent]:
        self.num_steps += 1
        max_seq_len, eos = self.config.session_len, self.backend.eos_token_ids
        events: list[TokenEvent] = []
        finished: list[str] = []
        for request_id, seq in self._running.items():
            token = self.backend.next_token_id(seq.last_token_id)
            reason = seq.append_token(token, eos_token_ids=eos, max_seq_len=max_seq_len)
            events.append(
                TokenEvent(request_id, token, None, reason, 0, len(seq.output_token_ids) - 1)
            )
            if reason is not None:
                finished.append(request_id)
        for request_id in finished:
            del self._running[request_id]
        return events
