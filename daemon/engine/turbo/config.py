"""What the turbo backend reads from a model's config.json, checked once at load.

The turbo model (`model.py`) implements one decoder: RMSNorm, rotary attention with
grouped KV heads, a gated MLP or a mixture of gated experts. The Llama family fits it
with a few switches (biases, sliding windows, tied embeddings, Qwen3's RMSNorm of each q
and k head, experts in Mixtral and Qwen3-MoE), and so does Gemma 3 (norms scaling by
1 + weight, a norm after attention and after the MLP too, a scaled embedding, GELU,
its own attention scale, local and global layers with rotary tables of their own);
everything else is refused here with one line that says why, so `auto` can fall back
to the torch backend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmd.engine.config import context_len

if TYPE_CHECKING:  # parallel.py imports torch.distributed; selection needs none of it
    from lmd.engine.parallel import TensorParallel

# Model classes whose checkpoints load unchanged into the turbo decoder.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma3ForCausalLM",
)
# The gated MLP's activation, by the config's name for it.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Architectures whose layers may hold experts instead of the dense MLP.
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
# Rotary variants whose frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModel(ValueError):
    """The model does not fit the turbo decoder; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The experts of a mixture-of-experts model (every sparse layer has the same)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each expert's gated MLP
    normalize_top_k: bool  # the k chosen probabilities are scaled to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModel(f"{self.top_k} experts per token of {self.num_experts} experts")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], arch: str, num_layers: int) -> MoeConfig | None:
        """Mixtral: experts in every layer, always normalized. Qwen3-MoE: in layer i when
        i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0 (as
        transformers builds it), normalized with `norm_topk_prob`."""
        num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        if arch not in MOE_ARCHITECTURES or num_experts == 0:
            return None
        if arch == "MixtralForCausalLM":
            return cls(
                num_experts=num_experts,
                top_k=int(raw["num_experts_per_tok"]),
                intermediate_size=int(raw["intermediate_size"]),
                normalize_top_k=True,
                sparse_layers=(True,) * num_layers,
            )
        dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
        step = int(raw.get("decoder_sparse_step", 1))
        return cls(
            num_experts=num_experts,
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            normalize_top_k=bool(raw.get("norm_topk_prob", False)),
            sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        )


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
    qk_norm: bool  # RMSNorm over each q and k head before rotation (Qwen3)
    moe: MoeConfig | None  # the experts, or None for a dense model
    # Per layer: attend to the last `window` keys only (key j visible from query p iff
    # p - j < window), or 0 for full attention.
    windows: tuple[int, ...]
    activation: str = "silu"  # of the gate: "silu" or "gelu_tanh" (Gemma)
    # Gemma 3: every RMSNorm scales by 1 + weight (folded into the weights at load), the
    # attention's and the MLP's outputs are normalized before the residual add, the
    # embedding is scaled, and the attention by query_pre_attn_scalar ** -0.5.
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float = 0.0  # 0: head_dim

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
    def attn_scale(self) -> float:
        return float((self.query_pre_attn_scalar or self.head_dim) ** -0.5)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_size(self) -> int:
        """Width of the fused q|k|v projection's output."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def for_rank(self, tp: TensorParallel) -> TurboConfig:
        """Rank tp.rank's share of the model (engine/parallel.py): its q and KV heads,
        its part of the MLP's and of each expert's width; the vocabulary stays whole (the
        ranks gather their logits). ParallelError names what does not divide."""
        if not tp.enabled:
            return self

        def share(n: int, what: str) -> int:
            tp.part(n, what)  # ParallelError unless tp.size divides n
            return n // tp.size

        # A head is never split: each rank's q heads keep their KV head (H / Hkv each).
        heads = share(self.num_heads, "attention heads")
        kv_heads = share(self.num_kv_heads, "KV heads")
        width = share(self.intermediate_size, "intermediate_size")
        moe = self.moe
        if moe is not None:
            expert_width = share(moe.intermediate_size, "the experts' intermediate_size")
            moe = replace(moe, intermediate_size=expert_width)
        return replace(
            self, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=width, moe=moe
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TurboConfig:
        """Parse a config.json dict; UnsupportedModel names what does not fit."""
        archs = raw.get("architectures") or ["unknown"]
        arch = str(archs[0])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {arch} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch == "Gemma3ForCausalLM"
        act = str(raw.get("hidden_activation" if gemma else "hidden_act") or "silu")
        if act not in ACTIVATIONS:
            raise UnsupportedModel(f"activation {act!r} is not one of {', '.join(ACTIVATIONS)}")
        for rope in rope_variants(raw):
            rope_type = str(rope.get("rope_type", rope.get("type", "default")))
            if rope_type not in STATIC_ROPE_TYPES:
                raise UnsupportedModel(
                    f"rope type {rope_type!r} is not one of {', '.join(STATIC_ROPE_TYPES)}"
                )
            partial = float(
                rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
            )
            if partial != 1.0:
                raise UnsupportedModel(f"partial_rotary_factor {partial} is not 1")
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if raw.get(cap):
                raise UnsupportedModel(f"{cap} {raw[cap]} is not implemented")
        if raw.get("use_bidirectional_attention"):
            raise UnsupportedModel("bidirectional attention is not causal decoding")
        if int(raw.get("pretraining_tp", 1)) != 1:
            raise UnsupportedModel("pretraining_tp > 1 splits the projections differently")
        num_heads = int(raw["num_attention_heads"])
        num_layers = int(raw["num_hidden_layers"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        attention_bias = bool(raw.get("attention_bias", False))
        qwen2 = arch == "Qwen2ForCausalLM"
        qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
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
            qk_norm=qwen3 or gemma,
            moe=MoeConfig.from_dict(raw, arch, num_layers),
            windows=layer_windows(raw, arch, num_layers),
            activation=ACTIVATIONS[act],
            norm_plus_one=gemma,
            sandwich_norms=gemma,
            embed_scale=hidden**0.5 if gemma else 1.0,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 0) if gemma else 0.0,
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


def rope_variants(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The rotary settings of each kind of layer: Gemma 3 nests one per layer type
    (`{"sliding_attention": {...}, "full_attention": {...}}`), the others have one."""
    params = rope_parameters(raw)
    nested = [v for v in params.values() if isinstance(v, dict)]
    return nested if nested and len(nested) == len(params) else [params]


def layer_windows(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """Sliding windows per layer, as transformers applies them.

    Mistral, Mixtral: `sliding_window` on every layer (null = none). Qwen3-MoE: the same,
    only with `use_sliding_window`. Qwen2, Qwen3: only on layers whose `layer_types`
    entry is "sliding_attention" (by default from layer `max_window_layers` on), and only
    with `use_sliding_window`. Gemma 3: on its "sliding_attention" layers (by default all
    but every `sliding_window_pattern`-th). Llama: none.
    """
    window = int(raw.get("sliding_window") or 0)
    if arch == "Gemma3ForCausalLM":
        pattern = int(raw.get("sliding_window_pattern") or 6)
        default = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                   for i in range(num_layers)]  # fmt: skip
        return windows_of(raw.get("layer_types") or default, window, num_layers)
    use_window = window > 0 and bool(raw.get("use_sliding_window", False))
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window,) * num_layers
    if arch == "Qwen3MoeForCausalLM":
        return (window if use_window else 0,) * num_layers
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not use_window:
        return (0,) * num_layers
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return windows_of(types, window, num_layers)


def windows_of(types: list[str], window: int, num_layers: int) -> tuple[int, ...]:
    """`window` on the "sliding_attention" layers of `types`, 0 on the others."""
    if len(types) != num_layers:
        raise UnsupportedModel(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(window if t == "sliding_attention" else 0 for t in types)
