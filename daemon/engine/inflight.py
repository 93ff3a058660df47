"""A decode step launched on the device and not read back yet (Engine's overlapped steps).

Overlapped decode steps (`EngineConfig.overlap_steps`, on by default on CUDA): a decode
step is launched (forward and sampling queued on the device, its tokens copied to pinned
host memory behind them) and left in flight; the next `step()` call schedules and
launches step N+1 first, feeding it step N's tokens straight from the device, and only
then waits for step N's tokens, appends them and returns their events. The host's work
for a step (scheduling, packing, sampler set-up, postprocessing) thus runs while the
device computes the previous one. Step N+1 runs ahead only when it is the same batch
again (no prompt to prefill, no sequence waiting to join, blocks free for every
sequence's next token); otherwise the engine reads step N back first and schedules as
usual. When a row's logits depend on step N's token (a penalty over the output so far,
a grammar: SamplingParams.needs_history), step N+1's forward is launched, step N read
back while it runs, and step N+1 sampled after, knowing every token. A sequence that
finished at step N has one wasted row in step N+1, whose token is dropped. Blocks that
a step in flight may still write into (a finished or aborted sequence's) are freed only
once it is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lmd.engine.decode_scheduler import DecodeBatch
from lmd.engine.sampler import SamplerOutput


@dataclass(slots=True)
class InFlight:
    """A decode step launched on the device whose tokens are not read back yet."""

    batch: DecodeBatch
    tokens: torch.Tensor  # [B] int64 on the device: the inputs of a step run ahead
    host: SamplerOutput  # host copies of the sampler's output, valid after wait()
    done: Any = None  # a torch.cuda.Event recorded after the copies; None on the CPU

    @classmethod
    def launch(cls, batch: DecodeBatch, out: SamplerOutput) -> InFlight:
        if out.token_ids.device.type != "cuda":
            return cls(batch, out.token_ids, out)
        host = out.to_host()
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        return cls(batch, out.token_ids, host, done)

    def wait(self) -> None:
        """Block until the step and its copies to the host are done."""
        if self.done is not None:
            self.done.synchronize()
