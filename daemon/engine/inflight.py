"""A decode step launched on the device and not read back yet (Engine's overlapped steps)."""

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
