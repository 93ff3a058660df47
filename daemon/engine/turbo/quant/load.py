"""Read one fused linear layer of a checkpoint in the form its scheme runs.

A fused linear is the row-wise concatenation of projections that run as one GEMM (q|k|v,
gate|up; o and down alone). 16-bit checkpoints are read as they are, then quantized when
`--quantization` asked for it; quantized checkpoints are read per projection from their
own tensors (AWQ and GPTQ: `qweight`, `qzeros`, `scales`, `g_idx`; FP8: `weight` with
`weight_scale_inv` or `weight_scale`) and concatenated in the quantized form. A
projection the checkpoint left unquantized (its `modules_to_not_convert`) is read
16-bit, and quantized at load when the rest of its fused layer is not.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch
from torch import Tensor

from lmd.engine.turbo.config import UnsupportedModel
from lmd.engine.turbo.quant.fp8 import Fp8Weight
from lmd.engine.turbo.quant.fp8_experts import Fp8Experts
from lmd.engine.turbo.quant.scheme import QuantScheme
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from lmd.engine.turbo.quant.w4a16_checkpoint import read_awq, read_gptq
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts

Linear = Tensor | W4A16Weight | Fp8Weight
Experts = Tensor | Fp8Experts | W4A16Experts  # a layer's experts of one projection, stacked


class Reader(Protocol):
    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str, dtype: torch.dtype | None, device: torch.device) -> Tensor: ...

    def splits(self, name: str) -> bool: ...


def load_linear(
    reader: Reader,
    prefixes: list[str],
    scheme: QuantScheme | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Linear:
    """The fused linear of `prefixes` (e.g. `model.layers.0.self_attn.q_proj`, ...): a
    [N, K] tensor in `dtype` without a scheme, else the scheme's weight of that shape.
    UnsupportedModel names the layer when its tensors do not fit the scheme."""
    try:
        packed = any(_packed(reader, p) for p in prefixes)
        if scheme is None or scheme.source == "load" or not packed:
            dense = _dense(reader, prefixes, dtype, device)
            return dense if scheme is None else quantize(dense, scheme, dtype)
        parts = [_part(reader, p, scheme, dtype, device) for p in prefixes]
        if scheme.method == "w4a16":
            return W4A16Weight.cat([p for p in parts if isinstance(p, W4A16Weight)])
        return Fp8Weight.cat([p for p in parts if isinstance(p, Fp8Weight)])
    except ValueError as exc:  # the weights' own checks: shapes, dtypes, group sizes
        raise UnsupportedModel(f"{', '.join(prefixes)}: {exc}") from None


def read_dense(
    reader: Reader,
    prefix: str,
    scheme: QuantScheme | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """One projection as a [N, K] tensor in `dtype`, whatever form the checkpoint holds
    it in: a quantized one is dequantized (a router; experts turbo runs 16-bit)."""
    if scheme is None or scheme.source == "load" or not _packed(reader, prefix):
        return reader.get(f"{prefix}.weight", dtype, device)
    try:
        return _part(reader, prefix, scheme, dtype, device).dequantize().to(dtype)
    except ValueError as exc:
        raise UnsupportedModel(f"{prefix}: {exc}") from None


def fold_down_order(
    gate_up: Linear, bias: Tensor | None, down: Linear
) -> tuple[Linear, Tensor | None, Linear]:
    """An act-order down's gather (W4A16Weight.perm) moved into gate|up: gate|up's
    outputs (rows gate | up, and its bias) made in the order down packs its inputs, and
    down reading them as they come (no gather). Exact, since act(gate) * up is
    elementwise over the intermediate width."""
    if not isinstance(down, W4A16Weight) or down.perm is None:
        return gate_up, bias, down
    if not isinstance(gate_up, W4A16Weight):
        return gate_up, bias, down
    outputs = torch.cat([down.perm, down.perm + down.shape[1]])  # gate's rows, then up's
    bias = None if bias is None else bias.index_select(0, outputs)
    return gate_up.take_outputs(outputs), bias, replace(down, perm=None)


def quantize(dense: Tensor, scheme: QuantScheme, dtype: torch.dtype) -> W4A16Weight | Fp8Weight:
    """A 16-bit [N, K] weight quantized at load by `scheme`'s method."""
    if scheme.method == "w4a16":
        return W4A16Weight.quantize(dense, scheme.group_size)
    return Fp8Weight.quantize(dense, dtype, scheme.block_size)  # a block checkpoint's blocks


def _dense(reader: Reader, prefixes: list[str], dtype: torch.dtype, device: torch.device) -> Tensor:
    tensors = [reader.get(f"{p}.weight", dtype, device) for p in prefixes]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _packed(reader: Reader, prefix: str) -> bool:
    """Whether the checkpoint holds this projection quantized."""
    return any(
        f"{prefix}.{name}" in reader for name in ("qweight", "weight_scale_inv", "weight_scale")
    )


def _part(
    reader: Reader, prefix: str, scheme: QuantScheme, dtype: torch.dtype, device: torch.device
) -> W4A16Weight | Fp8Weight:
    if not _packed(reader, prefix):  # left 16-bit by the checkpoint: quantize it like the rest
        return quantize(reader.get(f"{prefix}.weight", dtype, device), scheme, dtype)

    def stored(name: str, as_dtype: torch.dtype | None = None) -> Tensor:
        return reader.get(f"{prefix}.{name}", as_dtype, device)

    if scheme.source == "awq":
        return read_awq(
            stored("qweight"), stored("qzeros"), stored("scales", dtype), scheme.group_size, dtype
        )
    if scheme.source == "gptq":
        # A rank's part of the inputs (o, down under tensor parallelism) is in order,
        # act order being refused there (weights.py): its g_idx would be the whole's.
        g_idx_name = f"{prefix}.g_idx"
        g_idx = None
        if g_idx_name in reader and not reader.splits(g_idx_name):
            g_idx = stored("g_idx")
        return read_gptq(
            stored("qweight"),
            stored("qzeros"),
            stored("scales", dtype),
            g_idx,
            scheme.group_size,
            dtype,
            scheme.sym,
            zeros_minus_one=scheme.zeros_minus_one,
        )
    scale_name = "weight_scale_inv" if f"{prefix}.weight_scale_inv" in reader else "weight_scale"
    weight = stored("weight")
    if weight.dtype != torch.float8_e4m3fn:
        raise UnsupportedModel(f"{prefix}.weight is {weight.dtype}, not float8_e4m3fn")
    return Fp8Weight.from_checkpoint(
        weight, stored(scale_name, torch.float32), scheme.block_size, dtype
    )
