"""Quantized checkpoints as published (AutoAWQ, GPTQ v1, FP8 with 128x128 block scales),
written from a tiny Llama with known integer codes: turbo reads each fused linear as the
checkpoint means it, and an AWQ model computes what transformers computes on the same
weights dequantized. Without CUDA through Triton's interpreter (FP8 only loads there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

pytest.importorskip("triton")
from tests.unit.test_turbo_kernels import ON_CUDA  # noqa: I001  (first: the interpreter)

from lmd.engine.turbo.backend import TurboBackend
from lmd.engine.turbo.config import TurboConfig
from lmd.engine.turbo.quant.fp8 import fp8_supported
from lmd.engine.turbo.quant.scheme import read_scheme
from lmd.engine.turbo.weights import load_weights
from tests.models import random_prompts
from tests.unit.test_turbo_model import all_logits, assert_logits_match, reference_logits
from tests.unit.test_turbo_quant import dequantized_reference, pool
from tests.unit.test_turbo_quant import llama_dir  # noqa: F401  (a fixture: the 16-bit model)
from tests.unit.test_turbo_w4a16 import expected_dense, known_ints, pack_words

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
GROUP = 128
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_checkpoint(
    base: Path, out: Path, packed: dict[str, object], fmt: str
) -> dict[str, Tensor]:
    """`base`'s checkpoint with each linear replaced by `fmt`'s tensors of known codes;
    returns each linear's dense weight [N, K] (float32) as the checkpoint means it."""
    out.mkdir()
    tensors = load_file(str(base / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = packed
    (out / "config.json").write_text(json.dumps(config))
    dense: dict[str, Tensor] = {}
    torch.manual_seed(1)
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in PROJECTIONS]:
        prefix = name.removesuffix(".weight")
        n, k = tensors.pop(name).shape
        if fmt == "fp8":
            codes = (torch.randn(n, k) * 50).to(torch.float8_e4m3fn)
            scale = torch.rand(-(-n // 128), -(-k // 128)) / 100
            tensors[f"{prefix}.weight"] = codes
            tensors[f"{prefix}.weight_scale_inv"] = scale
            full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            dense[prefix] = codes.float() * full
            continue
        q, zeros, scales = known_ints(n, k, GROUP)  # q [K, N]
        scales = scales / 64  # small weights, as a trained model's
        if fmt == "awq":
            tensors[f"{prefix}.qweight"] = pack_words(q, 1, AWQ_ORDER).cpu()
            tensors[f"{prefix}.qzeros"] = pack_words(zeros, 1, AWQ_ORDER).cpu()
        else:  # GPTQ v1: codes packed along K, zero points less one
            zeros.clamp_(min=1)
            tensors[f"{prefix}.qweight"] = pack_words(q, 0, list(range(8))).cpu()
            tensors[f"{prefix}.qzeros"] = pack_words(zeros - 1, 1, list(range(8))).cpu()
            tensors[f"{prefix}.g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
        tensors[f"{prefix}.scales"] = scales.half().cpu()
        dense[prefix] = expected_dense(q, zeros, scales.half().float(), GROUP).cpu()
    save_file(tensors, str(out / "model.safetensors"))
    return dense


FORMATS: dict[str, dict[str, object]] = {
    "awq": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
    },
    "gptq": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "sym": False,
        "desc_act": False,
    },
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_fused_linear_is_what_the_checkpoint_means(
    llama_dir: Path,  # noqa: F811  (the fixture)
    tmp_path: Path,
    fmt: str,
) -> None:
    model = tmp_path / fmt
    dense = write_checkpoint(llama_dir, model, FORMATS[fmt], fmt)
    config = TurboConfig.load(model)
    scheme = read_scheme(json.loads((model / "config.json").read_text()), None)
    assert scheme is not None and scheme.source == ("checkpoint" if fmt == "fp8" else fmt)
    weights = load_weights(model, config, torch.device("cpu"), torch.bfloat16, scheme)
    for i, layer in enumerate(weights.layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        fused = {
            "qkv": [f"{attn}.{p}" for p in ("q_proj", "k_proj", "v_proj")],
            "o": [f"{attn}.o_proj"],
            "gate_up": [f"{mlp}.gate_proj", f"{mlp}.up_proj"],
            "down": [f"{mlp}.down_proj"],
        }
        for name, prefixes in fused.items():
            expected = torch.cat([dense[p] for p in prefixes])
            got = getattr(layer, name).dequantize().cpu()
            assert torch.equal(got, expected), f"layer {i} {name}"


def test_an_awq_model_computes_its_dequantized_weights(
    llama_dir: Path,  # noqa: F811  (the fixture)
    tmp_path: Path,
) -> None:
    model = tmp_path / "awq"
    write_checkpoint(llama_dir, model, FORMATS["awq"], "awq")
    dtype = torch.float16 if ON_CUDA else torch.float32
    turbo = TurboBackend(model, DEVICE, dtype)
    assert turbo.quantization == "w4a16 (awq, group 128)"
    ref = dequantized_reference(model, turbo, base=llama_dir)
    prompts = random_prompts([6, 21], turbo.vocab_size, seed=2)
    assert_logits_match(
        all_logits(turbo, prompts, pool(turbo)),
        reference_logits(ref, prompts),
        2e-2 if ON_CUDA else 1e-4,
    )


@pytest.mark.skipif(fp8_supported(DEVICE) is not None, reason="FP8 GEMMs need Hopper")
def test_fp8_block_codes_made_by_the_norms_change_no_logit(
    llama_dir: Path,  # noqa: F811  (the fixture)
    tmp_path: Path,
) -> None:
    """A block-scaled FP8 checkpoint: the norms and the activation making the products'
    per-group codes (TurboModel.fp8_codes) give the logits of the quantizer's launches,
    bit for bit (60 rows packed in one forward, then one-row decode steps)."""
    model = tmp_path / "fp8"
    write_checkpoint(llama_dir, model, FORMATS["fp8"], "fp8")
    turbo = TurboBackend(model, DEVICE, torch.bfloat16)
    prompts = random_prompts([3, 17, 40], turbo.vocab_size, seed=4)
    ours = torch.cat(all_logits(turbo, prompts, pool(turbo)))
    turbo.model.fp8_codes = False
    assert torch.equal(ours, torch.cat(all_logits(turbo, prompts, pool(turbo))))
