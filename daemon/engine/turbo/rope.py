"""The rotary table: cos and sin of every position's angles, computed once at load.

The inverse frequencies come from transformers' own rotary module for the model's
config (default, linear, llama3 and yarn scaling all fit a static table), so the angles
match the reference to the last bit of float32; yarn's attention scaling is folded in.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def rope_table(model_dir: Path, max_positions: int, device: torch.device) -> Tensor:
    """[max_positions, D] float32 on `device`: cos of the D/2 angles | their sin."""
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    # Qwen2's and Mistral's rotary modules are copies of Llama's.
    rotary = LlamaRotaryEmbedding(config=config)
    inv_freq = rotary.inv_freq.float()  # [D/2]
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    scaling = float(rotary.attention_scaling)
    table = torch.cat([angles.cos() * scaling, angles.sin() * scaling], dim=-1)
    return table.to(device).contiguous()
