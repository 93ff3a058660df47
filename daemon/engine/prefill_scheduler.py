"""Prefill scheduling: which prompt tokens each step computes. Pure: no I/O, no tensors.

Life cycle of a request in the prefill scheduler:
  1. `add(seq)` puts it at the back of `waiting` (a preempted sequence coming back for
     recompute goes to the front, with its prompt and output as the tokens to compute).
  2. `schedule()` admits waiting sequences in order while the block manager can hold
     all their tokens; the first that does not fit stops admission, so small prompts
     behind a big one never overtake it (back-pressure, no starvation). Admission
     allocates the blocks and skips tokens the prefix cache already holds.
  3. Each step packs chunks of admitted sequences up to `max_prefill_token_num` tokens,
     the partly computed one first; a long prompt spans several steps.
  4. `postprocess(batch, token_ids)` records the computed chunks and, for each sequence
     whose last chunk ran, appends its sampled token and hands it back: finished ones
     have been freed; the others keep their blocks and go to decode (hybrid) or
     migration, which now owns them.
  5. `abort(request_id)` frees the request wherever it is.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from lmd.engine.queues import SequenceQueues
from lmd.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True, frozen=True)
class PrefillChunk:
    """Tokens [start, end) of `seq.token_ids` to compute in this step."""

    seq: Sequence
    start: int
    end: int
    is_last: bool  # the prompt's final chunk: its last row's logits are sampled

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.end]


@dataclass(slots=True)
class PrefillBatch:
    chunks: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def seqs_to_sample(self) -> list[Sequence]:
        """Sequences whose prompt completes this step, in batch order."""
        return [c.seq for c in self.chunks if c.is_last]


class PrefillScheduler(SequenceQueues):
    def add(self, seq: Sequence, *, front: bool = False) -> None:
        """Queue `seq` for prefill; `front=True` for a preempted one to recompute."""
        if seq.num_tokens >= self.max_seq_len:
            raise ValueError(
                f"request {seq.request_id} has {seq.num_tokens} tokens; the limit is "
                f"{self.max_seq_len - 1} (session_len and KV pool size), leaving no room "
                "for output"
            )
        if seq.block_table or seq.is_finished:
            raise ValueError(f"request {seq.request_id} is finished or already holds blocks")
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens waiting or admitted that no step computed yet (the load routers
        see). The queues are copied first: status reads this while the engine steps."""
        seqs = [*list(self.waiting), *list(self.running)]
        return sum(s.num_tokens - s.num_cached_tokens for s in seqs)

    def schedule(self, max_new_seqs: int | None = None, budget: int | None = None) -> PrefillBatch:
        """The next step's chunks, at most `budget` tokens (max_prefill_token_num unless
        given); admits at most `max_new_seqs` new sequences.

        A hybrid engine passes the decode batch's free slots as `max_new_seqs`, so
        prefilled sequences never wait long for a place in decode while holding blocks.
        """
        if budget is None:
            budget = self.config.max_prefill_token_num
        batch = PrefillBatch()
        for seq in self.running:
            if budget <= 0:
                break
            budget -= self._add_chunk(batch, seq, budget)
        admitted = 0
        while self.waiting and budget > 0:
            if max_new_seqs is not None and admitted >= max_new_seqs:
                break
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted += 1
            budget -= self._add_chunk(batch, seq, budget)
        return batch

    def postprocess(self, batch: PrefillBatch, token_ids: SequenceOf[int]) -> list[Sequence]:
        """Record a computed step; `token_ids` are sampled for `batch.seqs_to_sample`.

        Returns the sequences whose prompt completed, with their token appended: the
        finished ones are freed; the others leave this scheduler with their blocks.
        """
        to_sample = batch.seqs_to_sample
        if len(token_ids) != len(to_sample):
            raise ValueError(
                f"expected {len(to_sample)} sampled tokens for the completed prompts, "
                f"got {len(token_ids)}"
            )
        sampled = dict(zip((id(s) for s in to_sample), token_ids, strict=True))
        done: list[Sequence] = []
        for chunk in batch.chunks:
            seq = chunk.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_cached_tokens = chunk.end
            self.block_manager.cache_full_blocks(seq)
            if not chunk.is_last:
                continue
            self.running.remove(seq)
            reason = seq.append_token(
                sampled[id(seq)], eos_token_ids=self.eos_token_ids, max_seq_len=self.max_seq_len
            )
            if reason is not None:
                self.block_manager.free(seq)
            else:
                seq.status = SequenceStatus.WAITING
            done.append(seq)
        return done

    def _add_chunk(self, batch: PrefillBatch, seq: Sequence, budget: int) -> int:
        start = seq.num_cached_tokens
        end = min(seq.num_tokens, start + budget)
        batch.chunks.append(PrefillChunk(seq, start, end, is_last=end == seq.num_tokens))
        return end - start
