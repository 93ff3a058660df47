"""What an engine will need on its GPU before its KV pool, estimated from the checkpoint and
config.json alone (no GPU, no loaded model), so that every engine of a device computes
the same numbers and the same plan (`memory_plan.py`).

The estimates only split the device between engines: each engine then measures its real
weights and activation peak (`memory_profile.py`) and sizes its pool inside its budget, so
an estimate that is low costs that engine some KV blocks, never another engine's memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lmd.engine.config import EngineConfig, context_len, read_hf_config, text_config
from lmd.engine.kv_layout import bytes_per_block
from lmd.engine.memory_plan import EngineNeeds
from lmd.engine.turbo.config import TurboConfig, UnsupportedModel
from lmd.engine.turbo.quant.scheme import four_bit_experts, read_scheme
from lmd.protocol.roles import Role

# cuBLAS workspaces, Triton's scratch, the allocator's rounding: beyond the activations.
RESERVE_SLACK_BYTES = 512 << 20
# A prefill engine wants KV for this many steps of prompts (migrating, being computed).
PREFILL_KV_STEPS = 4
# Bytes of the checkpoint's tensors that load as they are: integers (AWQ and GPTQ pack
# 4-bit weights in int32) and FP8 weights; the others load as the model's dtype.
_KEPT_ITEMSIZE = {
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
# Bytes per weight of a linear layer quantized at load (--quantization): 4 bits + a scale
# and a zero per group of 128 (W4A16); 1 byte + a float32 scale per row (FP8, rounded up).
_QUANTIZED_ITEMSIZE = {"w4a16": 0.5 + 4 / 128, "fp8": 1.0}
# The layers' linear weights, which --quantization quantizes (experts: _expert_itemsize).
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")
# An expert's tensors (`...mlp.experts.3.gate_proj.qweight`): turbo holds experts FP8
# under FP8 (the checkpoint's, or quantized at load), 4-bit under W4A16 where
# quant/scheme.py's four_bit_experts allows (else a 4-bit checkpoint's dequantized at
# load), and 16-bit otherwise.
_EXPERT = re.compile(r"model\.layers\.\d+\.\w+\.experts\.\d+\.\w+\.(\w+)")


def weight_bytes(model_dir: Path, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes of the model's weights once loaded as `dtype` (linear layers quantized at load
    with `quantization`): every tensor of its safetensors files (read from their headers),
    else the size of its weight files."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        other = [*Path(model_dir).glob("*.bin"), *Path(model_dir).glob("*.pt")]
        return sum(f.stat().st_size for f in other)
    four_bit = _four_bit_experts(Path(model_dir), quantization)
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is no dict)
                tensor = f.get_slice(name)
                kind = tensor.get_dtype()
                itemsize: float = _KEPT_ITEMSIZE.get(kind, dtype.itemsize)  # floats: as dtype
                if quantization is not None and _LINEAR.fullmatch(name):
                    itemsize = _QUANTIZED_ITEMSIZE[quantization]
                if expert := _EXPERT.fullmatch(name):
                    part = expert.group(1)
                    itemsize = _expert_itemsize(part, kind, dtype, quantization, four_bit)
                total += math.ceil(math.prod(tensor.get_shape()) * itemsize)
    return total


def _expert_itemsize(
    part: str, kind: str, dtype: torch.dtype, quantization: str | None, four_bit: bool
) -> float:
    """Bytes an expert's tensor takes loaded, an element: FP8 weights (an FP8 checkpoint's,
    or quantized at load: 1 byte and a float32 scale a row) as they are with their
    scales; 4-bit ones (`four_bit`: a checkpoint's, or rounded at load) as they are, their
    scales in `dtype` and a byte a zero point (8 in an int32 of `qzeros`); otherwise
    weights 16-bit whatever the checkpoint holds (an int32 of AWQ's or GPTQ's `qweight`
    packs 8 of them), their scales, zero points and g_idx read to dequantize, then
    freed."""
    if kind == "F8_E4M3" or part.startswith("weight_scale"):
        return _KEPT_ITEMSIZE.get(kind, 4)
    if four_bit:
        four_bits = {"qweight": 4, "scales": dtype.itemsize, "qzeros": 8, "weight": 0.5 + 3 / 128}
        return four_bits.get(part, 0)
    if part == "qweight":
        return 8 * dtype.itemsize
    if part != "weight":
        return 0
    return _QUANTIZED_ITEMSIZE["fp8"] if quantization == "fp8" else dtype.itemsize


def _four_bit_experts(model_dir: Path, quantization: str | None) -> bool:
    """Whether turbo will hold this model's experts 4-bit (quant/scheme.py)."""
    try:
        scheme = read_scheme(read_hf_config(model_dir), quantization)
        return scheme is not None and four_bit_experts(scheme, TurboConfig.load(model_dir))
    except (UnsupportedModel, OSError, ValueError):
        return False


def kv_bytes_per_token(
    hf_config: Mapping[str, Any], dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """K and V of one token in every layer: a pool block of one token."""
    c = text_config(hf_config)
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    layers = int(c["num_hidden_layers"])
    return bytes_per_block(layers, kv_heads, head_dim, 1, dtype, kv_cache_dtype=kv_cache_dtype)


def reserve_estimate(
    hf_config: Mapping[str, Any],
    role: Role,
    config: EngineConfig,
    dtype: torch.dtype,
    tp: int = 1,
) -> int:
    """The activation memory of the engine's largest steps: a prefill step of
    max_prefill_token_num tokens, float32 logits and sampler temporaries for up to
    max_batch_size rows, and (roles that decode) the CUDA graphs' pool and logits buffer.
    A rank of a tensor-parallel group of `tp` holds 1/tp of the heads and of the MLP's
    width, and the whole (gathered) logits."""
    c = text_config(hf_config)
    hidden = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    inter = int(c.get("intermediate_size") or 4 * hidden)
    if c.get("moe_intermediate_size"):  # routed experts: each token runs top-k of them
        inter = max(inter, int(c["moe_intermediate_size"]) * int(c.get("num_experts_per_tok", 2)))
    vocab = int(c["vocab_size"])
    # hidden, residual, normed, q|k|v, attention out, gate|up and the activation
    split = ((heads + 2 * kv_heads) * head_dim + 3 * inter) // tp
    per_token = dtype.itemsize * (3 * hidden + split)
    rows = min(config.max_batch_size, config.max_prefill_token_num)
    logits = rows * vocab * 4
    reserve = config.max_prefill_token_num * per_token + 3 * logits + RESERVE_SLACK_BYTES
    if role != Role.PREFILL:  # decode steps: graphs hold their activations and logits
        reserve += config.max_batch_size * (per_token + 2 * vocab * 4)
    return reserve


def engine_needs(
    name: str,
    role: Role,
    hf_config: Mapping[str, Any],
    *,
    weights: int,
    config: EngineConfig,
    dtype: torch.dtype,
    tp: int = 1,
) -> EngineNeeds:
    """The plan's inputs for one engine of a model whose weights take `weights` bytes; for
    a rank of a tensor-parallel group of `tp`, its shard's (1/tp of the weights and of the
    KV: the norms it keeps whole are a rounding error)."""
    wanted = None
    if role == Role.PREFILL:
        session = config.session_len or context_len(hf_config)
        tokens = max(PREFILL_KV_STEPS * config.max_prefill_token_num, session)
        wanted = tokens * kv_bytes_per_token(hf_config, dtype, config.kv_cache_dtype) // tp
    return EngineNeeds(
        name=name,
        role=role,
        weight_bytes=weights // tp,
        reserve_bytes=reserve_estimate(hf_config, role, config, dtype, tp),
        kv_wanted=wanted,
    )
