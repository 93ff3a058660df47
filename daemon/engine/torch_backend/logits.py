"""Float32 logits from a half-precision model, for the torch backend on CUDA.

transformers runs the output embedding (`lm_head`) in the model's dtype, so bf16 logits
keep 8 bits of mantissa: at |logit| ~ 16 the grid is 0.0625, and a greedy choice between
two logits closer than that is made by the rounding. cuBLAS accumulates in float32 anyway,
so `float_logits(model)` swaps the output-embedding Linear for one that asks for float32
output, as the turbo backend's lm_head does: the two backends then choose from logits of
the same precision. The model's own forward (soft-capping, scaling) runs on them as before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lmd.engine.backend import mm_has_float_output


class FloatOutputLinear(nn.Module):
    """y = x @ W^T + b in float32 from half-precision x and W; x: [..., in_features]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # the same Parameter: a tied embedding stays tied
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, in]
        y = torch.mm(flat, self.weight.t(), out_dtype=torch.float32)  # [N, out]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.reshape(*x.shape[:-1], y.shape[-1])


def float_logits(model: PreTrainedModel) -> bool:
    """Make `model` produce float32 logits where cuBLAS can; False if left as it was."""
    head = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    if not isinstance(head, nn.Linear) or not mm_has_float_output(head.weight):
        return False
    model.set_output_embeddings(FloatOutputLinear(head))  # type: ignore[no-untyped-call]
    return True
