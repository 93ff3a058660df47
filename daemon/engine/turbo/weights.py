"""Load a Llama-family checkpoint (safetensors) into the turbo decoder's fused layout.

Per layer, q/k/v become one [(H + 2 Hkv) * D, hidden] matrix and gate/up one
[2 I, hidden] matrix, so each runs as one GEMM; everything else keeps its Hugging Face
shape. Names are transformers' (`model.layers.{i}.self_attn.q_proj.weight`, ...), which
is also what lmd's GGUF conversion writes. Tensors the decoder does not use (e.g. old
`rotary_emb.inv_freq` buffers) are ignored; a missing one is an error that names it.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from lmd.engine.turbo.config import TurboConfig, UnsupportedModel


@dataclass(slots=True)
class LayerWeights:
    input_norm: Tensor  # [hidden]
    qkv: Tensor  # [(H + 2 Hkv) * D, hidden], rows q | k | v
    qkv_bias: Tensor | None  # [(H + 2 Hkv) * D]
    o: Tensor  # [hidden, H * D]
    o_bias: Tensor | None  # [hidden]
    post_norm: Tensor  # [hidden]
    gate_up: Tensor  # [2 I, hidden], rows gate | up
    gate_up_bias: Tensor | None  # [2 I]
    down: Tensor  # [hidden, I]
    down_bias: Tensor | None  # [hidden]


@dataclass(slots=True)
class ModelWeights:
    embed: Tensor  # [V, hidden]
    layers: list[LayerWeights]
    norm: Tensor  # [hidden]
    lm_head: Tensor  # [V, hidden]; the embedding itself when tied

    @property
    def nbytes(self) -> int:
        tensors: list[Tensor | None] = [self.embed, self.norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors.extend(getattr(layer, name) for name in LayerWeights.__slots__)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class CheckpointReader:
    """Tensors by name over every *.safetensors file of a directory (sharded or not)."""

    def __init__(self, model_dir: Path, device: torch.device, stack: ExitStack) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise UnsupportedModel(f"{model_dir} has no *.safetensors weights")
        # Load straight onto the GPU where there is one (no second host copy).
        where = str(device) if device.type == "cuda" else "cpu"
        self._where: dict[str, Any] = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device=where))
            for name in handle.keys():  # noqa: SIM118  # a safetensors handle, not a dict
                self._where[name] = handle
        self.model_dir = model_dir

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, dtype: torch.dtype, device: torch.device) -> Tensor:
        handle = self._where.get(name)
        if handle is None:
            raise UnsupportedModel(f"{self.model_dir} has no tensor {name}")
        tensor: Tensor = handle.get_tensor(name)
        return tensor.to(device=device, dtype=dtype)


def load_weights(
    model_dir: Path, config: TurboConfig, device: torch.device, dtype: torch.dtype
) -> ModelWeights:
    """Read the checkpoint in `model_dir` into fused tensors on `device` in `dtype`."""
    with ExitStack() as stack:
        reader = CheckpointReader(model_dir, device, stack)

        def get(name: str) -> Tensor:
            return reader.get(name, dtype, device)

        def cat(names: list[str]) -> Tensor:
            return torch.cat([get(n) for n in names])

        layers = []
        for i in range(config.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            qkv = [f"{attn}.{p}_proj" for p in "qkv"]
            gate_up = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
            layers.append(
                LayerWeights(
                    input_norm=get(f"model.layers.{i}.input_layernorm.weight"),
                    qkv=cat([f"{p}.weight" for p in qkv]),
                    qkv_bias=cat([f"{p}.bias" for p in qkv]) if config.qkv_bias else None,
                    o=get(f"{attn}.o_proj.weight"),
                    o_bias=get(f"{attn}.o_proj.bias") if config.o_bias else None,
                    post_norm=get(f"model.layers.{i}.post_attention_layernorm.weight"),
                    gate_up=cat([f"{p}.weight" for p in gate_up]),
                    gate_up_bias=cat([f"{p}.bias" for p in gate_up]) if config.mlp_bias else None,
                    down=get(f"{mlp}.down_proj.weight"),
                    down_bias=get(f"{mlp}.down_proj.bias") if config.mlp_bias else None,
                )
            )
        embed = get("model.embed_tokens.weight")
        # transformers ties the head to the embedding whenever the config says so, even
        # if the file also holds an lm_head tensor.
        lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
        weights = ModelWeights(
            embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=lm_head
        )
    check_shapes(weights, config)
    return weights


def check_shapes(weights: ModelWeights, config: TurboConfig) -> None:
    """Refuse a checkpoint whose tensors do not match its config (one line, the first)."""
    c = config
    expected: dict[str, tuple[int, ...]] = {
        "embed": (c.vocab_size, c.hidden_size),
        "lm_head": (c.vocab_size, c.hidden_size),
        "norm": (c.hidden_size,),
    }
    for name, shape in expected.items():
        got = tuple(getattr(weights, name).shape)
        if got != shape:
            raise UnsupportedModel(f"{name} is {got}, the config says {shape}")
    per_layer = {
        "qkv": (c.qkv_size, c.hidden_size),
        "o": (c.hidden_size, c.num_heads * c.head_dim),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }
    for i, layer in enumerate(weights.layers):
        for name, shape in per_layer.items():
            got = tuple(getattr(layer, name).shape)
            if got != shape:
                raise UnsupportedModel(f"layer {i} {name} is {got}, the config says {shape}")


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (as the torch backend)."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.exists():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(int(t) for t in eos) if isinstance(eos, list) else (int(eos),)
    return ()
