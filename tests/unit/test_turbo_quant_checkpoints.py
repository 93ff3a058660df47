"""Quantized checkpoints as published (AutoAWQ, GPTQ v1 in order and in act order, FP8
with 128x128 block scales), written from a tiny Llama with known integer codes: turbo
reads each fused linear as the checkpoint means it, and an AWQ or act-order GPTQ model
computes what transformers computes on the same weights dequantized. Without CUDA
through Triton's interpreter (FP8 only loads there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

pytest.importorskip("triton")
from tests.unit.test_turbo_kernels import ON_CUDA  # noqa: I001  (first: the interpreter)

from lmd.engine.turbo.backend import TurboBackend
from lmd.engine.turbo.config import TurboConfig
from lmd.engine.turbo.quant.fp8 import Fp8Weight, fp8_supported
from lmd.engine.turbo.quant.fp8_experts import Fp8Experts
from lmd.engine.turbo.quant.scheme import read_scheme
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts
from lmd.engine.turbo.weights import load_weights
from tests.models import TINY_SHAPE, random_prompts, save_tiny_llama
from tests.unit.test_turbo_model import all_logits, assert_logits_match, reference_logits
from tests.unit.test_turbo_quant import dequantized_reference, experts_dense, pool
from tests.unit.test_turbo_quant import llama_dir  # noqa: F401  (a fixture: the 16-bit model)
from tests.unit.test_turbo_w4a16 import known_ints
from tests.unit.test_turbo_w4a16_checkpoint import act_order_groups, expected_by_groups
from tests.unit.test_turbo_w4a16_checkpoint import pack_words

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
GROUP = 128
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUTS = {"q_proj": "x", "k_proj": "x", "v_proj": "x", "gate_proj": "x", "up_proj": "x"}
INPUTS |= {"o_proj": "o", "down_proj": "down"}  # the projections that read each input


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
    orders: dict[str, Tensor] = {}  # act order: g_idx by the input a projection reads
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
        g_idx = (torch.arange(k, device=q.device) // GROUP).int()  # input k's group
        if fmt == "gptq_act":  # one order an input: q, k and v see the same x
            module, projection = prefix.rsplit(".", 1)
            g_idx = orders.setdefault(module + INPUTS[projection], act_order_groups(k, GROUP))
        if fmt != "awq":
            tensors[f"{prefix}.g_idx"] = g_idx.cpu().clone()
        tensors[f"{prefix}.scales"] = scales.half().cpu()
        dense[prefix] = expected_by_groups(q, zeros, scales.half().float(), g_idx).cpu()
    save_file(tensors, str(out / "model.safetensors"))
    return dense


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every linear's K two or three groups of 128 (hidden 256, MLP 384): an act order
    then moves the inputs of every product (one group would leave them in place)."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("wide-llama"),
        hidden_size=256,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.05,
    )


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE, every K two or three groups of 128: layer 0 four experts (two a
    token), layer 1 a dense MLP."""
    fields = {
        **TINY_SHAPE,
        "hidden_size": 256,
        "intermediate_size": 384,
        "head_dim": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
        "initializer_range": 0.05,
    }
    config = Qwen3MoeConfig(**fields)
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("quant-moe")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def base_for(fmt: str, narrow: Path, wide: Path) -> Path:
    return wide if fmt == "gptq_act" else narrow


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
    "gptq_act": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "sym": False,
        "desc_act": True,
    },
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_fused_linear_is_what_the_checkpoint_means(
    llama_dir: Path,  # noqa: F811  (the fixture)
    wide_llama_dir: Path,
    tmp_path: Path,
    fmt: str,
) -> None:
    model = tmp_path / fmt
    dense = write_checkpoint(base_for(fmt, llama_dir, wide_llama_dir), model, FORMATS[fmt], fmt)
    config = TurboConfig.load(model)
    scheme = read_scheme(json.loads((model / "config.json").read_text()), None)
    assert scheme is not None
    assert scheme.source == {"fp8": "checkpoint", "gptq_act": "gptq"}.get(fmt, fmt)
    weights = load_weights(model, config, torch.device("cpu"), torch.bfloat16, scheme)
    stored = load_file(str(model / "model.safetensors"))
    for i, layer in enumerate(weights.layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        fused = {
            "qkv": [f"{attn}.{p}" for p in ("q_proj", "k_proj", "v_proj")],
            "o": [f"{attn}.o_proj"],
            "gate_up": [f"{mlp}.gate_proj", f"{mlp}.up_proj"],
            "down": [f"{mlp}.down_proj"],
        }
        # In act order down's gather is folded into gate|up (quant/load.py): down reads
        # its inputs in its packed order, gate|up makes them in that order.
        order = None
        if fmt == "gptq_act":
            order = torch.argsort(stored[f"{mlp}.down_proj.g_idx"].long(), stable=True)
        for name, prefixes in fused.items():
            expected = torch.cat([dense[p] for p in prefixes])
            if order is not None and name == "down":
                expected = expected[:, order]
            if order is not None and name == "gate_up":
                expected = expected[torch.cat([order, order + len(order)])]
            got = getattr(layer, name).dequantize().cpu()
            assert torch.equal(got, expected), f"layer {i} {name}"


def assert_computes_dequantized(turbo: TurboBackend, model: Path, base: Path) -> None:
    """turbo's logits on two prompts are transformers' on its weights, dequantized."""
    ref = dequantized_reference(model, turbo, base=base)
    prompts = random_prompts([6, 21], turbo.vocab_size, seed=2)
    assert_logits_match(
        all_logits(turbo, prompts, pool(turbo)),
        reference_logits(ref, prompts),
        2e-2 if ON_CUDA else 1e-4,
    )


@pytest.mark.parametrize(
    ("fmt", "described"),
    [("awq", "w4a16 (awq, group 128)"), ("gptq_act", "w4a16 (gptq, group 128, act order)")],
)
def test_a_4_bit_model_computes_its_dequantized_weights(
    llama_dir: Path,  # noqa: F811  (the fixture)
    wide_llama_dir: Path,
    tmp_path: Path,
    fmt: str,
    described: str,
) -> None:
    model, base = tmp_path / fmt, base_for(fmt, llama_dir, wide_llama_dir)
    write_checkpoint(base, model, FORMATS[fmt], fmt)
    dtype = torch.float16 if ON_CUDA else torch.float32
    turbo = TurboBackend(model, DEVICE, dtype)
    assert turbo.quantization == described
    if fmt == "gptq_act":  # gathered by the norms (qkv, gate|up), o's own; down's folded
        for layer in turbo.model.weights.layers:
            ordered = [getattr(layer, name).perm for name in ("qkv", "o", "gate_up", "down")]
            assert [p is not None for p in ordered] == [True, True, True, False]
    assert_computes_dequantized(turbo, model, base)


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


@pytest.mark.parametrize("fmt", ["awq", "gptq_act", "fp8"])
def test_quantized_experts_are_read_as_the_checkpoint_means(
    moe_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """An AWQ checkpoint's experts are kept as its 4-bit words (W4A16Experts), an act-order
    GPTQ one's dequantized at load (turbo runs them 16-bit), an FP8 checkpoint's kept as
    its codes and 128x128 block scales; either way each expert is what the checkpoint
    means, and the other linears stay quantized."""
    model = tmp_path / fmt
    dense = write_checkpoint(moe_dir, model, FORMATS[fmt], fmt)
    scheme = read_scheme(json.loads((model / "config.json").read_text()), None)
    config = TurboConfig.load(model)
    weights = load_weights(model, config, torch.device("cpu"), torch.bfloat16, scheme)
    experts = weights.layers[0].experts
    assert experts is not None
    if fmt == "fp8":
        assert isinstance(experts.gate_up, Fp8Experts) and experts.gate_up.block_size == (128, 128)
    elif fmt == "awq":
        assert isinstance(experts.gate_up, W4A16Experts) and experts.gate_up.group_size == 128
    else:
        assert isinstance(experts.gate_up, Tensor) and experts.gate_up.dtype == torch.bfloat16

    def rounded(t: Tensor) -> Tensor:  # as turbo holds it: kept exact, dequantized to bf16
        return t.to(torch.bfloat16).float() if fmt == "gptq_act" else t

    for j in range(4):
        expert = f"model.layers.0.mlp.experts.{j}"
        gate_up = torch.cat([dense[f"{expert}.gate_proj"], dense[f"{expert}.up_proj"]])
        assert torch.equal(experts_dense(experts.gate_up)[j], rounded(gate_up)), f"expert {j}"
        assert torch.equal(experts_dense(experts.down)[j], rounded(dense[f"{expert}.down_proj"]))
    for layer in weights.layers:
        assert isinstance(layer.qkv, W4A16Weight | Fp8Weight)


@pytest.mark.parametrize(
    ("fmt", "described"),
    [
        ("awq", "w4a16 (awq, group 128)"),
        ("gptq_act", "w4a16 (gptq, group 128, act order); experts 16-bit"),
        pytest.param(
            "fp8",
            "fp8 (blocks 128x128)",
            marks=pytest.mark.skipif(fp8_supported(DEVICE) is not None, reason="needs Hopper"),
        ),
    ],
)
def test_a_quantized_moe_model_computes_its_dequantized_weights(
    moe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, described: str
) -> None:
    """FP8: with the products' inputs kept 16-bit (as up to SMALL_ROWS rows, and the
    experts' past FP8_CODES_ROWS), their e4m3 rounding being tested on its own
    (test_fp8_at_load_stays_close_to_the_dequantized_model, test_turbo_fp8_experts.py)."""
    if fmt == "fp8":
        from lmd.engine.turbo.kernels import fp8 as fp8_kernels
        from lmd.engine.turbo.kernels import moe

        monkeypatch.setattr(fp8_kernels, "SMALL_ROWS", 1 << 30)
        monkeypatch.setattr(moe, "FP8_CODES_ROWS", 1 << 30)
    model = tmp_path / fmt
    write_checkpoint(moe_dir, model, FORMATS[fmt], fmt)
    dtype = torch.float16 if ON_CUDA else torch.float32
    turbo = TurboBackend(model, DEVICE, dtype)
    assert turbo.quantization == described
    assert_computes_dequantized(turbo, model, moe_dir)
