"""How a model's linear layers are quantized: what `--quantization` asks for, or what the
checkpoint's config.json says it holds (never both).

Checkpoints read: AutoAWQ (`quant_method` awq, 4 bits, zero points, GEMM packing),
AutoGPTQ / GPTQModel (gptq, 4 bits; `checkpoint_format` gptq or gptq_v2), and FP8 e4m3
(`fp8` with 128x128 block scales as Qwen3-FP8 and DeepSeek publish them; compressed-
tensors FP8 with a scale per output channel and dynamic per-token activations). Anything
else is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmd.engine.turbo.config import TurboConfig, UnsupportedModel
from lmd.engine.turbo.quant.w4a16 import PACK_K

READ_METHODS = ("awq", "gptq", "fp8", "compressed-tensors")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """method: "w4a16" or "fp8"; source: "load" (quantized here from 16-bit weights),
    "awq", "gptq" or "checkpoint" (fp8 as published)."""

    method: str
    source: str
    group_size: int = 128  # W4A16: weights per scale along K
    block_size: tuple[int, int] | None = None  # FP8 checkpoints: scale blocks (N, K)
    sym: bool = False  # GPTQ: symmetric (no stored zero points to speak of)
    zeros_minus_one: bool = False  # GPTQ v1 stores each zero point less one
    act_order: bool = False  # GPTQ desc_act: groups by g_idx, x in the packed order

    def describe(self) -> str:
        """One line for status and logs, e.g. "w4a16 (awq, group 128)"."""
        if self.method == "w4a16":
            origin = "round to nearest at load" if self.source == "load" else self.source
            order = ", act order" if self.act_order else ""
            return f"w4a16 ({origin}, group {self.group_size}{order})"
        if self.block_size is not None:
            return f"fp8 (blocks {self.block_size[0]}x{self.block_size[1]})"
        origin = "at load" if self.source == "load" else "checkpoint"
        return f"fp8 (per channel, {origin})"


def read_scheme(hf_config: Mapping[str, Any], requested: str | None) -> QuantScheme | None:
    """The scheme for a model: `requested` (--quantization) for a 16-bit checkpoint, the
    checkpoint's own for a quantized one, None for neither. UnsupportedModel (one line)
    for a checkpoint turbo cannot read or a request on an already quantized one."""
    packed = hf_config.get("quantization_config")
    if not packed:
        return None if requested is None else QuantScheme(requested, "load")
    if not isinstance(packed, Mapping):
        raise UnsupportedModel("config.json's quantization_config is not an object")
    method = str(packed.get("quant_method", "unknown")).lower()
    if requested is not None:
        raise UnsupportedModel(
            f"the checkpoint is already quantized ({method}); drop --quantization {requested}"
        )
    if method not in READ_METHODS:
        raise UnsupportedModel(
            f"turbo does not read {method} checkpoints (it reads {', '.join(READ_METHODS)})"
        )
    if method in ("awq", "gptq"):
        return _four_bit(method, packed)
    if method == "fp8":
        return _fp8(packed)
    return _compressed_fp8(packed)


def _four_bit(method: str, packed: Mapping[str, Any]) -> QuantScheme:
    bits = packed.get("bits", packed.get("w_bit"))
    if bits != 4:
        raise UnsupportedModel(f"turbo reads 4-bit {method} checkpoints, this one has {bits} bits")
    group = packed.get("group_size", packed.get("q_group_size"))
    if not isinstance(group, int) or group <= 0 or group % 32:
        raise UnsupportedModel(
            f"turbo reads {method} groups of a multiple of 32 weights, this one has {group}"
        )
    if method == "awq":
        version = str(packed.get("version", "gemm")).lower()
        if version != "gemm" or packed.get("zero_point", True) is not True:
            raise UnsupportedModel(
                f"turbo reads AWQ's GEMM packing with zero points, not {version} "
                f"(zero_point {packed.get('zero_point')})"
            )
        return QuantScheme("w4a16", "awq", group_size=group)
    fmt = str(packed.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModel(f"turbo reads GPTQ checkpoint formats gptq and gptq_v2, not {fmt}")
    return QuantScheme(
        "w4a16",
        "gptq",
        group_size=group,
        sym=bool(packed.get("sym", True)),
        zeros_minus_one=fmt == "gptq",
        act_order=packed.get("desc_act") is True,
    )


def _fp8(packed: Mapping[str, Any]) -> QuantScheme:
    if str(packed.get("activation_scheme", "dynamic")) != "dynamic":
        raise UnsupportedModel("turbo reads FP8 checkpoints with dynamic activation scales only")
    block = packed.get("weight_block_size")
    if block is None:
        return QuantScheme("fp8", "checkpoint")
    if list(block) != [128, 128]:
        raise UnsupportedModel(f"turbo reads FP8 blocks of 128x128, this one has {block}")
    return QuantScheme("fp8", "checkpoint", block_size=(128, 128))


def _compressed_fp8(packed: Mapping[str, Any]) -> QuantScheme:
    """compressed-tensors' "FP8-Dynamic": e4m3 weights, a scale per channel, activations
    quantized per token at run time. Other compressed-tensors schemes are refused."""
    groups = packed.get("config_groups") or {}
    for group in groups.values() if isinstance(groups, Mapping) else []:
        weights = group.get("weights") or {}
        acts = group.get("input_activations") or {}
        fp8_weights = weights.get("type") == "float" and weights.get("num_bits") == 8
        per_channel = weights.get("strategy") in ("channel", "tensor")
        dynamic = acts.get("dynamic") is True and acts.get("strategy") == "token"
        if not (fp8_weights and per_channel and dynamic):
            raise UnsupportedModel(
                "turbo reads compressed-tensors checkpoints of FP8 weights per channel with "
                "dynamic per-token activations only"
            )
    if not groups:
        raise UnsupportedModel("a compressed-tensors quantization_config without config_groups")
    return QuantScheme("fp8", "checkpoint")


def quantized_experts(scheme: QuantScheme, config: TurboConfig) -> bool:
    """Whether a model's MoE experts run in the scheme's form: FP8 always (Fp8Experts),
    W4A16 where four_bit_experts allows (W4A16Experts); else 16-bit, a quantized
    checkpoint's dequantized at load."""
    return scheme.method == "fp8" or four_bit_experts(scheme, config)


def four_bit_experts(scheme: QuantScheme, config: TurboConfig) -> bool:
    """Whether a W4A16 scheme's experts run 4-bit (W4A16Experts): their inputs in their
    own order (no act order), groups that divide 128 or are whole blocks of it, and every
    K (hidden, the rank's intermediate width) whole blocks of 128 and groups; else they
    run 16-bit, dequantized at load."""
    group = scheme.group_size
    if scheme.method != "w4a16" or scheme.act_order or config.moe is None:
        return False
    if PACK_K % group and group % PACK_K:
        return False
    unit = max(PACK_K, group)
    return not (config.hidden_size % unit or config.moe.intermediate_size % unit)
