"""4-bit linear weights with 16-bit activations (W4A16): quantized at load, or read from
an AutoAWQ or AutoGPTQ / GPTQModel checkpoint.

A weight W [N, K] is held in groups of G consecutive inputs (G = group_size, 128 by
default), each with a scale and an integer zero point per output channel:

    W[n, k] = (q[n, k] - zeros[k // G, n]) * scales[k // G, n]       q, zeros in 0..15

    qweight: [K / 8, N] int32   K in blocks of 128: word (16 b + r, n) holds
                                q[n, 128 b + 16 j + r] in bits 4 j .. 4 j + 3
    scales:  [K / G, N]         the activations' dtype (float16 or bfloat16)
    zeros:   [K / G, N] uint8

K is a multiple of 128 and of G; G is a multiple of 16. Packed along K, the GEMM reads
4 N contiguous bytes per row of words; the order inside a block of 128 makes each
nibble of 16 words one contiguous slice of K (kernels/w4a16.py says why). A checkpoint's
words are repacked once at load (quant/w4a16_checkpoint.py). An act-order GPTQ
checkpoint (desc_act) gives each input its group by its g_idx, not k // G: its inputs
are packed sorted by group, so that each group is G consecutive packed inputs again,
and x reaches the product in that order (`perm`: packed input i is input perm[i]),
made so by the RMSNorm before it (TurboModel) or gathered (`matmul`). `matmul` runs
kernels/w4a16.py; everything else is plain torch on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from lmd.engine.turbo.kernels.vector_gemv import Norm

PACK_K = 128  # inputs per block of the layout
_QUANTIZE_ELEMENTS = 1 << 22  # weights quantized at a time (bounds the float32 copies)


def pack(q: Tensor) -> Tensor:
    """q: [K, N] integers 0..15 -> our qweight [K / 8, N] int32 (K a multiple of 128):
    input 128 b + 16 j + r in bits 4 j of word row 16 b + r."""
    k, n = q.shape
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int32)
    fields = q.reshape(k // 128, 8, 16, n).to(torch.int32) << shifts[None, :, None, None]
    words = fields.sum(dim=1, dtype=torch.int32)  # disjoint bits: the sum is the OR
    return words.view(k // 8, n)


def unpack(qweight: Tensor) -> Tensor:
    """Our qweight [K / 8, N] int32 -> q [K, N] uint8 (pack's inverse)."""
    rows, n = qweight.shape
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    words = qweight.view(rows // 16, 1, 16, n)
    return ((words >> shifts[None, :, None, None]) & 0xF).to(torch.uint8).view(rows * 8, n)


@dataclass(slots=True)
class W4A16Weight:
    """qweight [K / 8, N] int32, scales [K / G, N] in the activations' dtype, zeros
    [K / G, N] uint8, group_size G; see the module. `in_features`: the dense weight's K
    when it is less than the packed K (a weight quantized at load with zero columns
    added up to a multiple of 128: the inputs are padded with zeros to match); None =
    the packed K. `perm`: [K] int64, the inputs' order as packed (act order), or None
    for the inputs in their own order."""

    qweight: Tensor
    scales: Tensor
    zeros: Tensor
    group_size: int = 128
    in_features: int | None = None
    perm: Tensor | None = None

    def __post_init__(self) -> None:
        if self.qweight.dtype != torch.int32 or self.qweight.dim() != 2:
            raise ValueError(
                f"W4A16 qweight is a [K/8, N] int32 matrix, not {self.qweight.dtype} "
                f"of shape {tuple(self.qweight.shape)}"
            )
        n, k = self.packed_shape
        g = self.group_size
        if self.in_features is not None and not 0 < self.in_features <= k:
            raise ValueError(f"W4A16 in_features {self.in_features} is not in 1..{k}")
        if g <= 0 or g % 16 or k % g or k % PACK_K:
            raise ValueError(
                f"W4A16 weight [{n}, {k}]: K must be a multiple of {PACK_K} and of the group "
                f"size {g}, itself a multiple of 16"
            )
        for name, tensor in (("scales", self.scales), ("zeros", self.zeros)):
            if tuple(tensor.shape) != (k // g, n):
                raise ValueError(
                    f"W4A16 {name} for weight [{n}, {k}] in groups of {g} is "
                    f"[{k // g}, {n}], not {list(tensor.shape)}"
                )
        if self.zeros.dtype != torch.uint8:
            raise ValueError(f"W4A16 zeros are uint8, not {self.zeros.dtype}")
        if not self.scales.is_floating_point():
            raise ValueError(f"W4A16 scales are floats, not {self.scales.dtype}")
        if self.perm is not None and (
            self.perm.dtype != torch.int64
            or tuple(self.perm.shape) != (k,)
            or self.in_features is not None
        ):
            raise ValueError(
                f"W4A16 perm for weight [{n}, {k}] is a [{k}] int64 order of unpadded "
                f"inputs, not {self.perm.dtype} of shape {list(self.perm.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): output features, input features of the dense weight."""
        n, k = self.packed_shape
        return (n, self.in_features or k)

    @property
    def packed_shape(self) -> tuple[int, int]:
        """(N, K) as packed: K a multiple of 128."""
        rows, n = self.qweight.shape
        return (n, rows * 8)

    @property
    def nbytes(self) -> int:
        """Bytes on the device: packed weights, scales, zero points and the order."""
        order = 0 if self.perm is None else self.perm.nbytes
        return self.qweight.nbytes + self.scales.nbytes + self.zeros.nbytes + order

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and output's) dtype: the scales'."""
        return self.scales.dtype

    def matmul(
        self,
        x: Tensor,
        bias: Tensor | None = None,
        activation: str | None = None,
        *,
        ordered: bool = False,
    ) -> Tensor:
        """x: [..., K] in `dtype` -> x @ W^T (+ bias): [..., N] in `dtype`; with
        `activation` W is gate | up and the result act(gate) * up, [..., N / 2] (SiLU made
        in the product's own launch where the wgmma kernel takes it: 33-64 rows).
        `ordered`: x's columns are already in the packed order (perm; an RMSNorm made
        them so), else an act-order weight gathers them first.

        The Triton kernel on a GPU, and on CPU under Triton's interpreter (tests); on CPU
        without it, dequantize() and F.linear (slow: a reference, not a serving path)."""
        from lmd.engine.turbo.kernels.common import interpreting  # triton, on first use

        n, k = self.shape
        if x.shape[-1] != k or x.dtype != self.dtype:
            raise ValueError(
                f"W4A16 matmul of [N={n}, K={k}] in {self.dtype} got x {tuple(x.shape)} "
                f"in {x.dtype}"
            )
        if activation is not None:
            return self._gated(x, bias, activation, ordered)
        if not x.is_cuda and not interpreting():
            dense = self.dequantize().to(x.dtype)
            if ordered and self.perm is not None:
                dense = dense[:, self.perm]  # packed input i is input perm[i]
            return F.linear(x, dense, bias)
        from lmd.engine.turbo.kernels.w4a16 import w4a16_matmul

        rows = self._packed_rows(x, ordered)
        padded = self.packed_shape[1] - k
        if padded:  # the zero columns added at load meet zero inputs
            rows = F.pad(rows, (0, padded))
        y = w4a16_matmul(rows, self.qweight, self.scales, self.zeros, self.group_size, bias)
        return y.view(*x.shape[:-1], n)

    def matmul_normed(
        self, x: Tensor, norm: Norm, bias: Tensor | None = None, activation: str | None = None
    ) -> tuple[Tensor, Tensor | None] | None:
        """One row's matmul of RMSNorm(x + norm.residual) (norm's weight and eps; no
        residual: RMSNorm(x)), the norm made in the product's launch, SiLU's gate too with
        `activation` "silu" (kernels/w4a16_normed.py): (the product, x + residual as
        rms_norm leaves its residual, or None without one). None where that kernel does
        not take it (no CUDA kernels, another activation, act order, a padded K, more
        rows): the caller then runs the norm and matmul."""
        from lmd.engine.turbo.kernels.w4a16_normed import native_normed

        n, k = self.shape
        if activation not in (None, "silu") or self.perm is not None or not x.is_cuda:
            return None
        if k != self.packed_shape[1] or tuple(x.shape) != (1, k) or norm.normed is not None:
            return None
        residual = norm.residual
        summed = None if residual is None else torch.empty_like(residual)
        gated = activation is not None
        y = x.new_empty(1, n // 2 if gated else n)
        weight = (self.qweight, self.scales, self.zeros, self.group_size)
        if native_normed(x, norm.weight, norm.eps, residual, summed, weight, bias, y, gated=gated):
            return y, summed
        return None

    def _gated(self, x: Tensor, bias: Tensor | None, activation: str, ordered: bool) -> Tensor:
        """act(gate) * up of W = gate | up: [..., N / 2]."""
        from lmd.engine.turbo.kernels.activation import silu_and_mul
        from lmd.engine.turbo.kernels.w4a16_rows import native_rows

        n, k = self.shape
        lead, rows = x.shape[:-1], x.reshape(-1, k)
        if activation == "silu" and x.is_cuda and k == self.packed_shape[1]:
            rows, ordered = self._packed_rows(x, ordered), True
            y = rows.new_empty(rows.shape[0], n // 2)
            weight = (self.qweight, self.scales, self.zeros, self.group_size)
            if native_rows(rows, *weight, bias, y, gated=True):
                return y.view(*lead, n // 2)
        y = silu_and_mul(self.matmul(rows, bias, ordered=ordered), activation)
        return y.view(*lead, n // 2)

    def _packed_rows(self, x: Tensor, ordered: bool) -> Tensor:
        """x [..., K] as the kernels read it: [M, K] rows of unit stride, the inputs in
        the packed order (gathered, for act order, unless `ordered`)."""
        from lmd.engine.turbo.kernels.norm import gather_columns

        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        return rows if self.perm is None or ordered else gather_columns(rows, self.perm)

    def dequantize(self) -> Tensor:
        """W as float32 [N, K]: (q - zero) * scale, the reference the kernel is held to."""
        q = unpack(self.qweight).float()  # [K, N]
        zeros = self.zeros.float().repeat_interleave(self.group_size, dim=0)
        scales = self.scales.float().repeat_interleave(self.group_size, dim=0)
        packed = ((q - zeros) * scales).t()[:, : self.shape[1]].contiguous()
        if self.perm is None:
            return packed
        dense = torch.empty_like(packed)
        dense[:, self.perm] = packed  # packed input i is input perm[i]
        return dense

    @classmethod
    def quantize(cls, weight: Tensor, group_size: int = 128) -> W4A16Weight:
        """A [N, K] half or float weight -> W4A16 on its device, scales in its dtype.

        Round to nearest, asymmetric, as AutoAWQ's zero_point=True: per group the range
        [min, max] (widened to hold 0, so that the zero point is an integer in 0..15 and
        every weight is within half a step) is cut in 15 steps; the scale is rounded up
        to the dtype so that max still lands on 15. Rows go a few at a time, so that a
        14336 x 4096 matrix needs no whole float32 copy. A K that is not a multiple of
        128 and of the group gets zero columns up to one (`in_features` keeps the real K):
        the last group then holds zeros too (they widen its range to 0, which it holds
        anyway)."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"quantize takes a [N, K] float matrix, not {tuple(weight.shape)}")
        if group_size <= 0 or group_size % 16 or (PACK_K % group_size and group_size % PACK_K):
            raise ValueError(
                f"quantize: the group size {group_size} is not a multiple of 16 that divides "
                f"or is a multiple of {PACK_K}"
            )
        in_features = weight.shape[1]
        unit = max(PACK_K, group_size)
        if in_features % unit:
            weight = F.pad(weight, (0, unit - in_features % unit))
        n, k = weight.shape
        groups = k // group_size
        device, dtype = weight.device, weight.dtype
        qweight = torch.empty(k // 8, n, dtype=torch.int32, device=device)
        scales = torch.empty(groups, n, dtype=dtype, device=device)
        zeros = torch.empty(groups, n, dtype=torch.uint8, device=device)
        step = max(1, _QUANTIZE_ELEMENTS // k)
        for r0 in range(0, n, step):
            w = weight[r0 : r0 + step].to(torch.float32, copy=True)  # never the caller's
            w = w.reshape(-1, groups, group_size)  # [r, groups, G]
            lo = w.amin(dim=2).clamp_(max=0.0)
            hi = w.amax(dim=2).clamp_(min=0.0)
            scale = _round_up((hi - lo) / 15, dtype)  # [r, groups] in dtype
            s = scale.float()
            zero = torch.round(-lo / s).clamp_(0, 15)
            q = w.div_(s[:, :, None]).round_().add_(zero[:, :, None]).clamp_(0, 15)
            qweight[:, r0 : r0 + step] = pack(q.view(-1, k).t().to(torch.uint8))
            scales[:, r0 : r0 + step] = scale.t()
            zeros[:, r0 : r0 + step] = zero.t().to(torch.uint8)
        return cls(qweight, scales, zeros, group_size, None if k == in_features else in_features)

    def take_outputs(self, index: Tensor) -> W4A16Weight:
        """The weight of outputs `index` ([N'] int64 of 0..N-1), in that order."""
        return W4A16Weight(
            self.qweight.index_select(1, index),
            self.scales.index_select(1, index),
            self.zeros.index_select(1, index),
            self.group_size,
            self.in_features,
            self.perm,
        )

    @staticmethod
    def cat(parts: list[W4A16Weight]) -> W4A16Weight:
        """The parts stacked along N (q|k|v, gate|up): same K, group size, dtype, device
        and inputs' order (GPTQ orders the projections of one input alike)."""
        if not parts:
            raise ValueError("W4A16Weight.cat needs at least one part")
        first = parts[0]
        key = (first.shape[1], first.group_size, first.dtype, first.device)
        for part in parts[1:]:
            other = (part.shape[1], part.group_size, part.dtype, part.device)
            if other != key:
                raise ValueError(
                    f"W4A16Weight.cat: parts differ in K, group size, dtype or device "
                    f"({other} vs {key})"
                )
            if not _same_order(first.perm, part.perm):
                raise ValueError(
                    "W4A16Weight.cat: the parts' act orders (g_idx) differ; turbo runs the "
                    "projections of one input as one product and needs one order"
                )
        return W4A16Weight(
            torch.cat([p.qweight for p in parts], dim=1),
            torch.cat([p.scales for p in parts], dim=1),
            torch.cat([p.zeros for p in parts], dim=1),
            first.group_size,
            first.in_features,
            first.perm,
        )


def _same_order(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a, b)


def _round_up(values: Tensor, dtype: torch.dtype) -> Tensor:
    """float32 -> dtype, rounded up (a scale never smaller than asked), at least the
    dtype's smallest normal (an all-zero group still gets a positive scale)."""
    tiny = torch.finfo(dtype).tiny
    rounded = values.clamp(min=tiny).to(dtype)
    up = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(rounded.float() < values, up, rounded)
