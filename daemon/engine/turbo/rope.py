"""The rotary table: cos and sin of every position's angles, computed once at load.

The inverse frequencies come from transformers' own rotary module for the model's
config (default, linear, llama3 and yarn scaling all fit a static table), so the angles
match the reference to the last bit of float32; yarn's attention scaling is folded in.
Gemma 3's local and global layers have tables of their own (`layer_rope_tables`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def rope_table(model_dir: Path, max_positions: int, device: torch.device) -> Tensor:
    """[max_positions, D] float32 on `device`: cos of the D/2 angles | their sin."""
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    return llama_table(config, max_positions, device)


def llama_table(config: Any, max_positions: int, device: torch.device) -> Tensor:
    # Qwen2's, Qwen3's and Mistral's rotary modules are copies of Llama's.
    rotary = LlamaRotaryEmbedding(config=config)
    return table_of(rotary.inv_freq, float(rotary.attention_scaling), max_positions, device)


def layer_rope_tables(model_dir: Path, max_positions: int, device: torch.device) -> list[Tensor]:
    """Each layer's table ([max_positions, D] float32): one shared by every layer, or
    for Gemma 3 one per layer type (local layers rotate with their own base)."""
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    config = getattr(config, "text_config", None) or config
    if config.model_type != "gemma3_text":
        return [llama_table(config, max_positions, device)] * config.num_hidden_layers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    rotary = Gemma3RotaryEmbedding(config=config)
    tables = {
        kind: table_of(
            getattr(rotary, f"{kind}_inv_freq"),
            float(getattr(rotary, f"{kind}_attention_scaling")),
            max_positions,
            device,
        )
        for kind in set(config.layer_types)
    }
    return [tables[kind] for kind in config.layer_types]


def table_of(inv_freq: Tensor, scaling: float, max_positions: int, device: torch.device) -> Tensor:
    """cos | sin of positions x inv_freq ([D/2]), times the attention scaling."""
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    table = torch.cat([angles.cos() * scaling, angles.sin() * scaling], dim=-1)
    return table.to(device).contiguous()
