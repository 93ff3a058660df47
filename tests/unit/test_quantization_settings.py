"""How quantization is asked for and reported: the scheme turbo reads from a checkpoint's
config.json or --quantization, the settings' checks, the backend choice, the memory
estimate, and what /v1/models and lmdctl status show."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig

from lmd.api.models import model_card
from lmd.config import ConfigError, ServeConfig
from lmd.engine.backend import BackendError
from lmd.engine.backends import select_backend
from lmd.engine.config import EngineConfig, checkpoint_quant_method
from lmd.engine.memory_needs import weight_bytes
from lmd.engine.turbo.config import UnsupportedModel
from lmd.engine.turbo.quant.scheme import QuantScheme, read_scheme
from lmd.pipeline.config import PytorchEngineConfig
from lmd_client.lmdctl import quantized
from tests.models import TINY_SHAPE

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
ARCH = "Qwen3MoeForCausalLM"
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
FP8_BLOCKS = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
FP8_DYNAMIC = {
    "quant_method": "compressed-tensors",
    "config_groups": {
        "group_0": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "dynamic": True,
                "strategy": "token",
            },
            "targets": ["Linear"],
        }
    },
}


@pytest.mark.parametrize(
    ("packed", "expected"),
    [
        (AWQ, QuantScheme("w4a16", "awq")),
        ({**AWQ, "group_size": 64}, QuantScheme("w4a16", "awq", group_size=64)),
        (GPTQ, QuantScheme("w4a16", "gptq", sym=True, zeros_minus_one=True)),
        ({**GPTQ, "checkpoint_format": "gptq_v2", "sym": False}, QuantScheme("w4a16", "gptq")),
        (
            {**GPTQ, "desc_act": True},
            QuantScheme("w4a16", "gptq", sym=True, zeros_minus_one=True, act_order=True),
        ),
        (FP8_BLOCKS, QuantScheme("fp8", "checkpoint", block_size=(128, 128))),
        (FP8_DYNAMIC, QuantScheme("fp8", "checkpoint")),
    ],
)
def test_a_checkpoints_own_quantization_is_read(
    packed: dict[str, Any], expected: QuantScheme
) -> None:
    assert read_scheme({"quantization_config": packed}, None) == expected


def test_quantization_at_load_and_descriptions() -> None:
    assert read_scheme({}, None) is None
    assert read_scheme({}, "w4a16") == QuantScheme("w4a16", "load")
    assert QuantScheme("w4a16", "load").describe() == "w4a16 (round to nearest at load, group 128)"
    assert QuantScheme("w4a16", "awq").describe() == "w4a16 (awq, group 128)"
    assert QuantScheme("fp8", "load").describe() == "fp8 (per channel, at load)"
    blocks = read_scheme({"quantization_config": FP8_BLOCKS}, None)
    assert blocks is not None and blocks.describe() == "fp8 (blocks 128x128)"


@pytest.mark.parametrize(
    ("packed", "requested", "message"),
    [
        (AWQ, "fp8", "already quantized \\(awq\\); drop --quantization fp8"),
        ({"quant_method": "bitsandbytes"}, None, "does not read bitsandbytes checkpoints"),
        ({**AWQ, "bits": 8}, None, "4-bit awq checkpoints, this one has 8 bits"),
        ({**AWQ, "version": "gemv"}, None, "GEMM packing"),
        ({**GPTQ, "group_size": -1}, None, "groups of a multiple of 32"),
        ({**GPTQ, "checkpoint_format": "marlin"}, None, "not marlin"),
        ({**FP8_BLOCKS, "weight_block_size": [64, 64]}, None, "blocks of 128x128"),
        ({**FP8_BLOCKS, "activation_scheme": "static"}, None, "dynamic activation scales"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            None,
            "FP8 weights per channel",
        ),
    ],
)
def test_what_turbo_cannot_read_is_refused_in_one_line(
    packed: dict[str, Any], requested: str | None, message: str
) -> None:
    with pytest.raises(UnsupportedModel, match=message):
        read_scheme({"quantization_config": packed}, requested)


def test_settings_check_their_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of fp8, w4a16"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig().quantized is None
    both = EngineConfig(quantization="w4a16", kv_cache_dtype="int8")
    assert both.quantized == "--quantization w4a16 and --kv-cache-dtype int8"
    config = ServeConfig(runtime_dir=tmp_path, quantization="fp8", kv_cache_dtype="fp8")
    engine = config.engine_on("cuda:0")
    assert (engine.quantization, engine.kv_cache_dtype) == ("fp8", "fp8")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        ServeConfig(runtime_dir=tmp_path, kv_cache_dtype="int4")


def test_the_pipeline_takes_lmdeploys_quant_policy() -> None:
    assert PytorchEngineConfig(quant_policy=8).engine_config().kv_cache_dtype == "int8"
    assert PytorchEngineConfig().engine_config().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="no 4-bit KV cache"):
        PytorchEngineConfig(quant_policy=4)


def test_auto_does_not_fall_back_to_a_backend_that_cannot_run_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": AWQ}))
    assert checkpoint_quant_method(tmp_path) == "awq"
    with pytest.raises(BackendError, match="a awq checkpoint runs on backend turbo only"):
        select_backend("auto", "LlamaForCausalLM", "cpu", tmp_path)
    with pytest.raises(BackendError, match="--kv-cache-dtype int8 runs on backend turbo only"):
        select_backend("auto", "LlamaForCausalLM", "cpu", quantized="--kv-cache-dtype int8")


def test_the_memory_plan_counts_weights_as_they_will_load(tmp_path: Path) -> None:
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(256, 128, dtype=torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(128, 256, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.zeros(100, 128, dtype=torch.bfloat16),
        "model.layers.0.mlp.up_proj.qweight": torch.zeros(128, 32, dtype=torch.int32),
        "model.layers.1.mlp.up_proj.weight": torch.zeros(64, 64).to(torch.float8_e4m3fn),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    linear, embed, packed, fp8 = 2 * 256 * 128, 100 * 128, 128 * 32 * 4, 64 * 64
    assert weight_bytes(tmp_path, torch.bfloat16) == 2 * (linear + embed) + packed + fp8
    # --quantization: the 16-bit linears at their quantized size (fp8: 1 byte a weight).
    assert weight_bytes(tmp_path, torch.bfloat16, "fp8") == linear + 2 * embed + packed + 1 * fp8
    w4 = weight_bytes(tmp_path, torch.bfloat16, "w4a16")
    assert w4 == pytest.approx((linear + fp8) * (0.5 + 4 / 128) + 2 * embed + packed, abs=2)


def gptq_gate(expert: str) -> dict[str, torch.Tensor]:
    """A GPTQ checkpoint's gate_proj of `expert`, 128 inputs x 256 outputs, as stored."""
    return {
        f"{expert}.gate_proj.qweight": torch.zeros(16, 256, dtype=torch.int32),
        f"{expert}.gate_proj.qzeros": torch.zeros(1, 32, dtype=torch.int32),
        f"{expert}.gate_proj.scales": torch.zeros(1, 256, dtype=torch.float16),
        f"{expert}.gate_proj.g_idx": torch.zeros(128, dtype=torch.int32),
    }


def test_the_memory_plan_counts_experts_as_they_will_load(tmp_path: Path) -> None:
    """Without a config.json that lets turbo keep them 4-bit (none here), a 4-bit
    checkpoint's experts count as dequantized at load (2 bytes a weight in bf16, their
    scales and zero points nothing); an FP8 checkpoint's are kept (1 byte and its float32
    scales), and --quantization fp8 makes 16-bit experts 1 byte a weight."""
    expert = "model.layers.0.mlp.experts.3"
    tensors = gptq_gate(expert) | {
        f"{expert}.up_proj.weight": torch.zeros(256, 128).to(torch.float8_e4m3fn),
        f"{expert}.up_proj.weight_scale_inv": torch.zeros(2, 1, dtype=torch.bfloat16),
        f"{expert}.down_proj.weight": torch.zeros(128, 256, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    size = 128 * 256
    fp8_up = size + 2 * 4
    assert weight_bytes(tmp_path, torch.bfloat16) == 2 * size + fp8_up + 2 * size
    assert weight_bytes(tmp_path, torch.bfloat16, "w4a16") == 2 * size + fp8_up + 2 * size
    assert weight_bytes(tmp_path, torch.bfloat16, "fp8") == 2 * size + fp8_up + size


def test_the_memory_plan_counts_four_bit_experts_kept_four_bit(tmp_path: Path) -> None:
    """A Qwen3-MoE whose widths are whole groups keeps a GPTQ checkpoint's experts 4-bit
    (4 bytes a qweight int32, the scales in bf16, a byte a zero point) and rounds 16-bit
    experts to 4 bits at --quantization w4a16; an act-order checkpoint's stay 16-bit."""
    fields = {
        "hidden_size": 128,
        "moe_intermediate_size": 256,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    config = Qwen3MoeConfig(**(TINY_SHAPE | fields)).to_dict() | {"architectures": [ARCH]}
    expert = "model.layers.0.mlp.experts.3"
    tensors = gptq_gate(expert)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    size = 128 * 256
    for quant, kept in ((GPTQ, size // 2 + 2 * 256 + 256), (GPTQ | {"desc_act": True}, 2 * size)):
        (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
        assert weight_bytes(tmp_path, torch.bfloat16) == kept
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(
        {f"{expert}.up_proj.weight": torch.zeros(256, 128)}, str(tmp_path / "model.safetensors")
    )
    assert weight_bytes(tmp_path, torch.bfloat16, "w4a16") == size * (0.5 + 3 / 128)
    assert weight_bytes(tmp_path, torch.bfloat16) == 2 * size


def test_v1_models_and_lmdctl_show_the_quantization(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"quantization_config": GPTQ}))
    card = model_card(ServeConfig(runtime_dir=tmp_path, model=str(model)), created=1)
    assert (card["quantization"], card["kv_cache_dtype"]) == ("gptq", "auto")
    asked = ServeConfig(runtime_dir=tmp_path, quantization="w4a16", kv_cache_dtype="int8")
    card = model_card(asked, created=1)
    assert (card["quantization"], card["kv_cache_dtype"]) == ("w4a16", "int8")
    assert model_card(ServeConfig(runtime_dir=tmp_path), 1)["quantization"] is None
    assert quantized({"quantization": "w4a16 (awq, group 128)", "kv_cache_dtype": "int8"}) == (
        "w4a16 (awq, group 128) kv int8"
    )
    assert quantized({"quantization": None, "kv_cache_dtype": "auto"}) == "-"
    assert quantized({"backend": "torch"}) == "-"  # an older worker's status
