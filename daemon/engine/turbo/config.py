"""What the turbo backend reads from a model's config.json, checked once at load.

The turbo model (`model.py`) implements one decoder: RMSNorm, rotary attention with
grouped KV heads, a SiLU-gated MLP. The Llama family fits it with a few switches
(biases, sliding windows, tied embeddings); everything else is refused here with one
line that says why, so `auto` can fall back to the torch backend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmd.engine.config import context_len

# Model classes whose checkpoints load unchanged into the turbo decoder.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Rotary variants whose frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModel(ValueError):
    """The model does not fit the turbo decoder; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class TurboConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q, k and v projections have a bias (Qwen2, Llama attention_bias)
    o_bias: bool  # the output projection has one (Llama attention_bias)
    mlp_bias: bool
    # Per layer: attend to the last `window` keys only (key j visible from query p iff
    # p - j < window), or 0 for full attention.
    windows: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"{self.num_heads} attention heads do not split evenly over "
                f"{self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2 or self.head_dim > 256:
            raise UnsupportedModel(f"head_dim {self.head_dim} must be even and at most 256")
        if len(self.windows) != self.num_layers:
            raise ValueError("windows needs one entry per layer")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_size(self) -> int:
        """Width of the fused q|k|v projection's output."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TurboConfig:
        """Parse a config.json dict; UnsupportedModel names what does not fit."""
        archs = raw.get("architectures") or ["unknown"]
        arch = str(archs[0])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {arch} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"hidden_act {act!r} is not silu")
        rope = rope_parameters(raw)
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModel(
                f"rope type {rope_type!r} is not one of {', '.join(STATIC_ROPE_TYPES)}"
            )
        partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise UnsupportedModel(f"partial_rotary_factor {partial} is not 1")
        if int(raw.get("pretraining_tp", 1)) != 1:
            raise UnsupportedModel("pretraining_tp > 1 splits the projections differently")
        num_heads = int(raw["num_attention_heads"])
        num_layers = int(raw["num_hidden_layers"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        attention_bias = bool(raw.get("attention_bias", False))
        qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=context_len(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=not qwen2 and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            windows=layer_windows(raw, arch, num_layers),
        )

    @classmethod
    def load(cls, model_dir: Path) -> TurboConfig:
        path = model_dir / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UnsupportedModel(f"cannot read {path}: {exc}") from exc
        try:
            return cls.from_dict(raw)
        except KeyError as exc:
            raise UnsupportedModel(f"{path} has no {exc.args[0]!r}") from exc


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings: transformers 5 writes `rope_parameters`, 4.x `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return dict(params) if isinstance(params, dict) else {}


def layer_windows(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """Sliding windows per layer, as transformers applies them.

    Mistral: `sliding_window` on every layer (null = none). Qwen2: only on layers whose
    `layer_types` entry is "sliding_attention" (by default from layer `max_window_layers`
    on), and only with `use_sliding_window`. Llama: none.
    """
    window = raw.get("sliding_window")
    if arch == "MistralForCausalLM":
        return (int(window or 0),) * num_layers
    if arch != "Qwen2ForCausalLM" or not window or not raw.get("use_sliding_window", False):
        return (0,) * num_layers
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise UnsupportedModel(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)
