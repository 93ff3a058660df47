"""What the prefill and decode schedulers share: their two queues, the length cap, abort.

Pure: no I/O, no tensors. `waiting` holds sequences not yet admitted (FIFO); `running`
holds admitted ones, oldest first. The block manager owns block tables; a scheduler
owns the status of the sequences in its queues.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable

from lmd.engine.block_manager import BlockManager
from lmd.engine.config import EngineConfig
from lmd.engine.sequence import FinishReason, Sequence


class SequenceQueues:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids: Collection[int] = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def max_seq_len(self) -> int:
        """Longest sequence this engine holds: session_len, and what the pool fits."""
        pool = self.block_manager.max_num_tokens
        session_len = self.config.session_len
        return pool if session_len is None else min(session_len, pool)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_seqs(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Free and finish `request_id` if it is here; returns it, or None."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.block_manager.free(seq)
                    seq.finish(FinishReason.ABORT)
                    return seq
        return None
