"""Decode scheduling: the persistent running batch. Pure: no I/O, no tensors.

Life cycle of a request in the decode scheduler:
  1. `add(seq)` takes a sequence whose prompt is computed (all but its last token
     cached in its blocks: prefilled in this process, or migrated into reserved
     blocks) and puts it in `waiting`.
  2. `schedule()` first gives every running sequence room for its last token, oldest
     first. When no block is free it preempts the most recently admitted sequence
     (possibly the one asking): its blocks are freed and it is returned in
     `batch.preempted`, to be put at the front of a prefill queue and recomputed
     (prompt + output). Sequences already given room are never touched. Then it
     admits waiting sequences in order while the batch has a slot and a block.
  3. `postprocess(batch, token_ids)` appends one sampled token per sequence, finishes
     it on a stop or eos token (not before min_new_tokens, eos not with ignore_eos),
     max_tokens or session_len (finish_reason `length`), and frees finished ones; with
     a sliding window on every layer, blocks behind it go back to the pool.
  4. `abort(request_id)` frees the request wherever it is.
A step may also be scheduled before the last step's tokens are known (the engine's
overlap of host and device work): `schedule_ahead()` gives every running sequence room
for one token more than it holds, or returns None (sequences waiting, or too few blocks:
the engine then waits for the tokens and schedules normally). `postprocess(...,
free=False)` leaves finished sequences' blocks to the caller, which frees them once the
step that ran ahead, and may still write into them, is done.

A hybrid engine drives both schedulers over one block manager:
    pre = prefill.schedule(max_new_seqs=max_batch_size - decode.num_seqs - prefill.num_running)
    run(pre); for seq in prefill.postprocess(pre, tokens): decode.add(seq) unless finished
    dec = decode.schedule(); for seq in dec.preempted: prefill.add(seq, front=True)
    run(dec); decode.postprocess(dec, tokens)
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from lmd.engine.queues import SequenceQueues
from lmd.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class DecodeBatch:
    """One decode step: each of `seqs` feeds its last token and samples the next."""

    seqs: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # newest first; recompute them

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class DecodeScheduler(SequenceQueues):
    def add(self, seq: Sequence) -> None:
        """Queue a prefilled sequence (KV of all but its last token in its blocks)."""
        if seq.is_finished:
            raise ValueError(f"request {seq.request_id} is already finished")
        if seq.num_cached_tokens != seq.num_tokens - 1:
            raise ValueError(
                f"request {seq.request_id} has {seq.num_tokens} tokens but "
                f"{seq.num_cached_tokens} cached; decode needs all but the last cached"
            )
        if len(seq.block_table) < self.block_manager.num_blocks_needed(seq.num_cached_tokens):
            raise ValueError(f"request {seq.request_id} has too few blocks for its cached tokens")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> DecodeBatch:
        """The next step's batch, growing each sequence by one token's room."""
        batch = DecodeBatch()
        block_size = self.block_manager.block_size
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            # Room already (most steps: the last block is not full), or made now.
            has_room = seq.num_tokens <= len(seq.block_table) * block_size
            if has_room or self._make_room(seq, batch.preempted):
                batch.seqs.append(seq)
                i += 1
        while self.waiting and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            if not self.block_manager.can_append(seq):
                if self.running:
                    break  # wait for running sequences to finish and free blocks
                # Nothing runs, so nothing will free blocks: make room from the newest
                # waiting sequences (the head itself, as a last resort).
                victim = self.waiting.pop()
                self._preempt(victim, batch.preempted)
                continue
            self.waiting.popleft()
            self.block_manager.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
        return batch

    def schedule_ahead(self) -> DecodeBatch | None:
        """The running batch again, each sequence with room for its pending token too.

        For a step launched before the previous one's tokens are appended: it feeds each
        sequence's pending token (at position num_tokens). None, with nothing changed,
        when sequences wait to join or the blocks it needs are not free.
        """
        if self.waiting or not self.running:
            return None
        bm = self.block_manager
        if sum(bm.num_missing(s, s.num_tokens + 1) for s in self.running) > bm.num_free_blocks:
            return None
        for seq in self.running:
            bm.append(seq, seq.num_tokens + 1)
        return DecodeBatch(seqs=list(self.running))

    def postprocess(
        self, batch: DecodeBatch, token_ids: SequenceOf[int], *, free: bool = True
    ) -> list[Sequence]:
        """Append one sampled token per `batch.seqs`; returns the sequences that finished.

        Their blocks are freed unless `free` is False (the caller frees them later).
        """
        if len(token_ids) != len(batch.seqs):
            raise ValueError(
                f"expected {len(batch.seqs)} sampled tokens, one per sequence, got {len(token_ids)}"
            )
        finished: list[Sequence] = []
        # Once per step, not per sequence (this loop runs for every token).
        eos, max_seq_len = self.eos_token_ids, self.max_seq_len
        caching = self.block_manager.enable_prefix_caching
        windowed = self.block_manager.window > 0
        for seq, token_id in zip(batch.seqs, token_ids, strict=True):
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_cached_tokens = seq.num_tokens
            if caching:
                self.block_manager.cache_full_blocks(seq)
            if windowed:  # blocks no later query sees go back to the pool
                self.block_manager.release_behind_window(seq)
            reason = seq.append_token(token_id, eos_token_ids=eos, max_seq_len=max_seq_len)
            if reason is not None:
                self.running.remove(seq)
                if free:
                    self.block_manager.free(seq)
                finished.append(seq)
        return finished

    def _make_room(self, seq: Sequence, preempted: list[Sequence]) -> bool:
        """Room for `seq`'s last token, preempting newer sequences; False if `seq` went."""
        while not self.block_manager.can_append(seq):
            victim = self.running.pop()
            self._preempt(victim, preempted)
            if victim is seq:
                return False
        self.block_manager.append(seq)
        return True

    def _preempt(self, seq: Sequence, preempted: list[Sequence]) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        preempted.append(seq)
