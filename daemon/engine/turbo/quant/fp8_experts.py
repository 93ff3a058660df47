"""A layer of experts' projections in FP8 (e4m3), stacked: the form kernels/moe.py's
grouped GEMM and kernels/moe_vector.py's one-token path read.

weight [E, N, K] float8_e4m3fn, W[e] ~= weight[e] * scale[e], with the scales of
quant/fp8.py's Fp8Weight a layer deeper: [E, ceil(N/128), ceil(K/128)] for 128x128 blocks
(Qwen3-30B-A3B-FP8's experts as published), [E, N] for one per output channel
(`--quantization fp8` at load, compressed-tensors checkpoints). The kernels read the
codes, widen them to the activations' 16-bit type (exact: e4m3's 3 mantissa bits fit in
bfloat16's 7 and float16's 10) and scale each block's (or row's) product: 16-bit
activations, half the weight bytes of a 16-bit expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from lmd.engine.turbo.quant.e4m3 import BLOCK
from lmd.engine.turbo.quant.fp8 import Fp8Weight, block_scale_shape


@dataclass(slots=True)
class Fp8Experts:
    weight: Tensor  # [E, N, K] float8_e4m3fn
    scale: Tensor  # float32 [E, ceil(N/128), ceil(K/128)] (blocks) or [E, N] (per channel)
    block_size: tuple[int, int] | None
    dtype: torch.dtype  # the activations'

    def __post_init__(self) -> None:
        if self.weight.dim() != 3:
            raise ValueError(f"fp8 experts are [E, N, K], not {tuple(self.weight.shape)}")
        self.expert(0)  # the codes', the scales' and the dtype's checks, on one expert

    @classmethod
    def empty(
        cls,
        shape: tuple[int, int, int],
        block_size: tuple[int, int] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Fp8Experts:
        """Room for E experts of [N, K], filled by `put`."""
        e, n, k = shape
        scale_shape = (e, n) if block_size is None else (e, *block_scale_shape(n, k))
        weight = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
        return cls(
            weight, torch.empty(scale_shape, dtype=torch.float32, device=device), block_size, dtype
        )

    @classmethod
    def quantize(
        cls, stacked: Tensor, dtype: torch.dtype, block_size: tuple[int, int] | None = None
    ) -> Fp8Experts:
        """A 16-bit [E, N, K] stack of experts quantized expert by expert
        (Fp8Weight.quantize: a scale a row, or 128x128 blocks)."""
        e, n, k = stacked.shape
        out = cls.empty((e, n, k), block_size, dtype, stacked.device)
        for j in range(e):
            out.put(j, 0, Fp8Weight.quantize(stacked[j], dtype, block_size))
        return out

    def put(self, expert: int, row: int, part: Fp8Weight) -> None:
        """Expert `expert`'s rows from `row` (gate at 0, up at I) are `part`'s; for blocks
        `row` and the part's rows are whole blocks (no block spans two projections)."""
        n, k = part.shape
        if part.block_size != self.block_size or k != self.weight.shape[2]:
            raise ValueError(
                f"an fp8 part [{n}, {k}] with blocks {part.block_size} in experts "
                f"{tuple(self.weight.shape)} with blocks {self.block_size}"
            )
        self.weight[expert, row : row + n] = part.weight
        if self.block_size is None:
            self.scale[expert, row : row + n] = part.scale
            return
        if row % BLOCK or n % BLOCK:
            raise ValueError(f"block-scaled expert rows {row}..{row + n} are not whole blocks")
        self.scale[expert, row // BLOCK : (row + n) // BLOCK] = part.scale

    def expert(self, index: int) -> Fp8Weight:
        """Expert `index`'s weight as an Fp8Weight (views, no copy)."""
        return Fp8Weight(self.weight[index], self.scale[index], self.block_size, self.dtype)

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.weight.shape
        return (e, n, k)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def dequantize(self) -> Tensor:
        """The experts as float32 [E, N, K]."""
        return torch.stack([self.expert(j).dequantize() for j in range(self.shape[0])])


class Operands(NamedTuple):
    """What the experts' kernels take for a weight: `codes` (the weight itself when
    16-bit), `scale_args` (the scales and their expert, row and K-block strides: the
    scale of expert e's row n in the K slice from k0 is scale[e * s_e + n * s_n] for a
    scale a row, scale[e * s_e + (n // 128) * s_n + (k0 // 128) * s_k] for blocks) and
    `scales`, the kernels' SCALES: 0 none (16-bit), 1 a scale a row, 128 blocks."""

    codes: Tensor
    scale_args: tuple[Tensor, int, int, int]
    scales: int

    def block_k(self, block_k: int) -> int:
        """A kernel's K slice, within one block for blocks."""
        return min(block_k, BLOCK) if self.scales == BLOCK else block_k


def kernel_operands(weight: Tensor | Fp8Experts, unread: Tensor) -> Operands:
    """`weight`'s Operands; a 16-bit weight's scale arguments are `unread` and zeros."""
    if not isinstance(weight, Fp8Experts):
        return Operands(weight, (unread, 0, 0, 0), 0)
    s = weight.scale
    if weight.block_size is None:  # one scale a row, whatever the slice
        return Operands(weight.weight, (s, s.stride(0), s.stride(1), 0), 1)
    return Operands(weight.weight, (s, s.stride(0), s.stride(1), s.stride(2)), BLOCK)
