"""A layer of experts' projections in 4 bits (W4A16), stacked: the form kernels/moe.py's
grouped GEMM reads (an AWQ or GPTQ MoE checkpoint's experts as published, or quantized at
`--quantization w4a16`).

Expert e is quant/w4a16.py's W4A16Weight of qweight[e], scales[e], zeros[e]:

    qweight [E, K / 8, N] int32     each expert's words in quant/w4a16.py's layout
    scales  [E, K / G, N]           the activations' dtype
    zeros   [E, K / G, N] uint8

K (an expert's inputs) a multiple of 128 and of G. The grouped GEMM makes the words 16-bit
weights in registers, 128 inputs at a time (kernels/moe.py), and multiplies on 16-bit
tensor cores: a quarter of a 16-bit expert's bytes. Inputs in their own order only: an
act-order expert (each its own g_idx) or a K off 128 stays 16-bit
(quant/scheme.py's four_bit_experts decides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lmd.engine.turbo.quant.w4a16 import PACK_K, W4A16Weight


@dataclass(slots=True)
class W4A16Experts:
    qweight: Tensor  # [E, K / 8, N] int32
    scales: Tensor  # [E, K / G, N] in the activations' dtype
    zeros: Tensor  # [E, K / G, N] uint8
    group_size: int

    def __post_init__(self) -> None:
        if self.qweight.dim() != 3:
            raise ValueError(f"W4A16 experts are [E, K / 8, N], not {tuple(self.qweight.shape)}")
        self.expert(0)  # the layout's, the scales' and the zeros' checks, on one expert

    @classmethod
    def empty(
        cls, shape: tuple[int, int, int], group_size: int, dtype: torch.dtype, device: torch.device
    ) -> W4A16Experts:
        """Room for E experts of [N, K] (K a multiple of 128 and of the group), filled by
        `put`."""
        e, n, k = shape
        if k % PACK_K or k % group_size:
            raise ValueError(f"W4A16 experts' K {k} is not a multiple of {PACK_K} and {group_size}")
        groups = (e, k // group_size, n)
        return cls(
            torch.empty(e, k // 8, n, dtype=torch.int32, device=device),
            torch.empty(groups, dtype=dtype, device=device),
            torch.empty(groups, dtype=torch.uint8, device=device),
            group_size,
        )

    @classmethod
    def quantize(cls, stacked: Tensor, group_size: int) -> W4A16Experts:
        """A 16-bit [E, N, K] stack of experts quantized expert by expert
        (W4A16Weight.quantize: round to nearest, asymmetric, in groups)."""
        e, n, k = stacked.shape
        out = cls.empty((e, n, k), group_size, stacked.dtype, stacked.device)
        for j in range(e):
            out.put(j, 0, W4A16Weight.quantize(stacked[j], group_size))
        return out

    def put(self, expert: int, row: int, part: W4A16Weight) -> None:
        """Expert `expert`'s outputs from `row` (gate at 0, up at I) are `part`'s: its
        inputs in their own order (no act order), none added at load, the stack's groups."""
        n, k = part.shape
        fits = part.perm is None and part.in_features is None and k == self.shape[2]
        if not fits or part.group_size != self.group_size:
            raise ValueError(
                f"a W4A16 part [{n}, {k}] in groups of {part.group_size} (act order: "
                f"{part.perm is not None}) in experts {self.shape} in groups of {self.group_size}"
            )
        self.qweight[expert, :, row : row + n] = part.qweight
        self.scales[expert, :, row : row + n] = part.scales
        self.zeros[expert, :, row : row + n] = part.zeros

    def expert(self, index: int) -> W4A16Weight:
        """Expert `index`'s weight as a W4A16Weight (views, no copy)."""
        return W4A16Weight(
            self.qweight[index], self.scales[index], self.zeros[index], self.group_size
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K), as a 16-bit stack's."""
        e, rows, n = self.qweight.shape
        return (e, n, rows * 8)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and outputs') dtype: the scales'."""
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes + self.zeros.nbytes

    def dequantize(self) -> Tensor:
        """The experts as float32 [E, N, K]."""
        return torch.stack([self.expert(j).dequantize() for j in range(self.shape[0])])
