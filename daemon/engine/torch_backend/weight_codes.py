"""float32 weights that are exactly codes: a GGUF's Q4_1 or Q8_0 blocks, dequantized.

A GGUF checkpoint (the embedded SmolLM2 is one: Q4_1 linears, a Q8_0 embedding) is
converted to float32 safetensors at first use (model_source.py), each weight dequantized
per block of 32 inputs as llama.cpp stores it:

    Q4_1: w = d * q + m, q in 0..15, d and m float16
    Q8_0: w = d * q, q in -128..127, d float16  (= d * (q + 128) + (-128 d))

Held as float32, a decode step reads 4 bytes a weight; held as the codes, 0.5 or 1 plus
the blocks' d and m. `find_codes` re-derives the codes from the float32 weight (m the
block's least value, or -128 d; d from the block's range, rounded to float16) and keeps
them only if every weight comes back bitwise: then lmd._native.panel_gemm with bits 4
or 8 (native/panel_gemm.h), which rebuilds each weight in registers with one FMA (d * q
is exact in float32, so the FMA rounds once, as the conversion did), gives bitwise the
float32 product. It pays where the float32 product is bound by its reads (one row: a
step 20% shorter on two cores; at 8 rows it is bound by FMAs and evens out). A weight
from anywhere else (a safetensors checkpoint, a random model) fails the check at its
first block and stays float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

GROUP = 32  # inputs per block in GGUF's Q4_1 and Q8_0


@dataclass(frozen=True)
class WeightCodes:
    """A weight [n, k] (n a multiple of 8) as panel_gemm takes it with bits 4 or 8."""

    bits: int  # 4 or 8
    codes: Tensor  # 4: [n / 8, k] int32, output j in bits 4j..4j+3; 8: [n / 8, k, 8] uint8
    scales: Tensor  # d: [n / 8, k / GROUP, 8] float32
    mins: Tensor  # m: [n / 8, k / GROUP, 8] float32


def find_codes(weight: Tensor) -> WeightCodes | None:
    """The codes of a float32 `weight` [n, k] (n a multiple of 8) if it is exactly a
    dequantized Q4_1 (tried first) or Q8_0 weight, else None."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or n % 8 or k % GROUP or not k:
        return None
    blocks = weight.reshape(n, k // GROUP, GROUP)
    for bits in (4, 8):
        if _exact_codes(blocks[:8], bits) is None:  # most weights fail on their first rows
            continue
        found = _exact_codes(blocks, bits)
        if found is not None:
            return _panels(bits, *found)
    return None


def _exact_codes(blocks: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """(q [n, g, GROUP] in 0..2^bits - 1, d [n, g, 1], m [n, g, 1]) with q * d + m equal
    to `blocks` bit for bit, or None."""
    lo, hi = torch.aminmax(blocks, dim=-1, keepdim=True)
    if bits == 4:
        d = ((hi - lo) / 15).half().float()
    else:
        d = (torch.maximum(hi, -lo) / 127).half().float()
        lo = d * -128
    if not bool(torch.isfinite(d).all()):
        return None
    q = torch.sub(blocks, lo).div_(torch.where(d > 0, d, 1.0)).round_().clamp_(0, 2**bits - 1)
    if not torch.equal(torch.addcmul(lo, q, d), blocks):  # q * d exact: one rounding
        return None
    return q, d, lo


def _panels(bits: int, q: Tensor, d: Tensor, lo: Tensor) -> WeightCodes:
    """The panel layout (outputs in eights) of codes q [n, g, GROUP], d and m [n, g, 1]."""
    n, groups, _ = q.shape
    per_input = q.reshape(n // 8, 8, groups * GROUP).transpose(1, 2).to(torch.uint8)
    if bits == 4:  # eight 4-bit codes, one per output, in one 32-bit word per input
        nibbles = per_input.numpy().astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))
        words = np.bitwise_or.reduce(nibbles, axis=-1).view(np.int32)
        codes = torch.from_numpy(np.ascontiguousarray(words))
    else:
        codes = per_input.contiguous()

    def per_group(v: Tensor) -> Tensor:
        return v.reshape(n // 8, 8, groups).transpose(1, 2).contiguous()

    return WeightCodes(bits, codes, per_group(d), per_group(lo))


@dataclass(frozen=True)
class CodePairs:
    """Codes as lmd._native.pair_gemm takes them (native/pair_gemm.h)."""

    bits: int  # 4 or 8
    # 4: [ceil(n / 16), k / 2, 16] uint8, input 2i's code low, 2i + 1's high;
    # 8: [ceil(n / 16), k / 2, 16, 2] uint8, the two codes side by side
    codes: Tensor
    scales: Tensor  # d: [2 ceil(n / 16), k / GROUP, 8] float32 (a padded panel of zeros)
    mins: Tensor  # m: the same


def code_pairs(codes: WeightCodes) -> CodePairs:
    """`codes` in pair_gemm's layout: the same codes, d and m, inputs paired."""
    if codes.bits == 4:
        words = codes.codes  # [P, k] int32, output j in bits 4j..4j+3
        q = (words[:, :, None] >> (4 * torch.arange(8, dtype=torch.int32))) & 0xF  # [P, k, 8]
    else:
        q = codes.codes.int()  # [P, k, 8]
    panels, k, _ = q.shape
    scales, mins = codes.scales, codes.mins
    if panels % 2:  # a panel of zeros: the kernel takes panels two at a time
        q = torch.cat([q, q.new_zeros(1, k, 8)])
        scales = torch.cat([scales, scales.new_zeros(1, *scales.shape[1:])])
        mins = torch.cat([mins, mins.new_zeros(1, *mins.shape[1:])])
    q = q.view(-1, 2, k // 2, 2, 8)  # [pair, panel of the pair, i, input 2i / 2i + 1, j]
    if codes.bits == 4:
        both = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [pair, panel, k / 2, 8]
        pairs = both.permute(0, 2, 1, 3).reshape(-1, k // 2, 16)
    else:  # [pair, i, panel, j, input]: output 8 panel + j's two codes side by side
        pairs = q.permute(0, 2, 1, 4, 3).reshape(-1, k // 2, 16, 2)
    pairs = pairs.to(torch.uint8).contiguous()
    return CodePairs(codes.bits, pairs, scales.contiguous(), mins.contiguous())
