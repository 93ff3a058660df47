"""FP8 experts (quant/fp8_experts.py) in the experts' kernels: the grouped GEMM, a layer
of experts through kernels/moe.py and through the one-token path (kernels/moe_vector.py),
each against the same math in float32 on the codes times their scales (the weights as
they are meant). With 128x128 blocks (K of two and three blocks, so that a slice's block
changes along K) and with a scale per row (K not a multiple of 128); with the inputs
16-bit and as e4m3 codes. And the loading: `--quantization fp8` quantizes each expert
per row (one by one or stacked), a block checkpoint off whole blocks is refused. Through
Triton's interpreter without CUDA (float16: the interpreter's dots take no bfloat16).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import DEVICE, ON_CUDA, TOLERANCE, rel_err

pytest.importorskip("triton")

from lmd.engine.turbo.config import TurboConfig, UnsupportedModel
from lmd.engine.turbo.kernels import moe, moe_align, moe_vector
from lmd.engine.turbo.kernels.vector_gemv import Norm, vector_gemv
from lmd.engine.turbo.quant.fp8 import Fp8Weight, quantize_per_token_ref
from lmd.engine.turbo.quant.fp8_experts import Fp8Experts
from lmd.engine.turbo.quant.scheme import QuantScheme, read_scheme
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts
from lmd.engine.turbo.weights import load_weights
from tests.models import TINY_SHAPE
from tests.unit.test_turbo_moe import moe_ref
from tests.unit.test_turbo_quant_checkpoints import (
    FORMATS,
    moe_dir,  # noqa: F401  (a fixture)
    write_checkpoint,
)

CPU = torch.device("cpu")

DTYPES = [torch.float16, torch.bfloat16] if ON_CUDA else [torch.float16]
BLOCKS = [(128, 128), None]
IDS = ["blocks", "per-row"]
# Hidden 256 (two blocks) and I 384 (three) with blocks; I 96 with a scale a row.
SHAPES = {(128, 128): (256, 384), None: (256, 96)}


def fp8_experts(
    shape: tuple[int, int, int], blocks: tuple[int, int] | None, dtype: torch.dtype, seed: int
) -> Fp8Experts:
    """E random experts of [N, K] quantized one by one (as a checkpoint's or at load)."""
    e, n, k = shape
    gen = torch.Generator().manual_seed(seed)
    ranges = torch.arange(1, e + 1)[:, None, None] / 8  # each expert its own range
    return Fp8Experts.quantize(
        (torch.randn(e, n, k, generator=gen) * ranges).to(DEVICE), dtype, blocks
    )


def experts_layer(
    blocks: tuple[int, int] | None, dtype: torch.dtype, num_experts: int, seed: int
) -> tuple[Tensor, Fp8Experts, Fp8Experts]:
    hidden, inter = SHAPES[blocks]
    router = torch.randn(num_experts, hidden, generator=torch.Generator().manual_seed(seed))
    gate_up = fp8_experts((num_experts, 2 * inter, hidden), blocks, dtype, seed)
    down = fp8_experts((num_experts, hidden, inter), blocks, dtype, seed + 1)
    return router.to(dtype).to(DEVICE), gate_up, down


def test_experts_hold_their_parts_codes_and_scales() -> None:
    part = Fp8Weight.quantize(torch.randn(128, 256), torch.float16, (128, 128))
    experts = Fp8Experts.empty((2, 256, 256), (128, 128), torch.float16, CPU)
    experts.put(1, 128, part)  # up's rows of an expert whose gate is rows 0..127
    assert torch.equal(experts.expert(1).dequantize()[128:], part.dequantize())
    assert experts.shape == (2, 256, 256) and experts.nbytes == 2 * 256 * 256 + 2 * 2 * 2 * 4
    with pytest.raises(ValueError, match="not whole blocks"):
        experts.put(0, 64, part)
    with pytest.raises(ValueError, match="blocks None"):
        experts.put(0, 0, Fp8Weight.quantize(torch.randn(128, 256), torch.float16))
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        Fp8Experts(part.weight, part.scale, (128, 128), torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", BLOCKS, ids=IDS)
@pytest.mark.parametrize("num_tokens", [3, 70])
def test_the_grouped_gemm_of_fp8_experts_is_their_meaning(
    dtype: torch.dtype, blocks: tuple[int, int] | None, num_tokens: int
) -> None:
    """gate|up's and down's products with 16-bit inputs against float32 products with the
    dequantized experts (the activation and the routing weights: fused_moe's tests)."""
    _, gate_up, down = experts_layer(blocks, dtype, 4, num_tokens)
    assert_grouped_gemms(gate_up, down, SHAPES[blocks], dtype, num_tokens)


def assert_grouped_gemms(
    gate_up: Fp8Experts | W4A16Experts,
    down: Fp8Experts | W4A16Experts,
    shape: tuple[int, int],
    dtype: torch.dtype,
    num_tokens: int,
) -> None:
    """gate|up's and down's grouped GEMMs (4 experts, 2 a token, routed at random; random
    16-bit inputs) each within TOLERANCE[dtype] of float32 products with the dequantized
    experts, in `dtype`; shape: (hidden, the experts' width)."""
    (hidden, inter), num_experts, top_k = shape, 4, 2
    gen = torch.Generator().manual_seed(num_tokens)
    h = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    experts = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen).to(DEVICE)
    num_pairs = num_tokens * top_k
    block_m = moe_align.block_rows(num_pairs, num_experts)
    layout = moe_align.align(experts, num_experts, block_m)
    flat = experts.flatten().cpu()
    act = torch.randn(num_pairs, inter, generator=gen).to(dtype).to(DEVICE)  # down's input
    for weight, rows, div in ((gate_up, h, top_k), (down, act, 1)):
        out = moe.grouped_gemm(
            rows, weight, *layout, num_pairs=num_pairs, a_row_div=div, block_m=block_m
        )
        dense = weight.dequantize().cpu()
        ref = torch.stack(
            [dense[int(flat[p])] @ rows[p // div].float().cpu() for p in range(num_pairs)]
        )
        assert out.dtype == dtype and rel_err(out.cpu(), ref) < TOLERANCE[dtype], weight.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", BLOCKS, ids=IDS)
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 2), (40, 2), (9, 4)])
def test_a_layer_of_fp8_experts_equals_the_loop(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    blocks: tuple[int, int] | None,
    num_tokens: int,
    top_k: int,
) -> None:
    """fused_moe on FP8 experts, and (one token) the one-token path, against transformers'
    loop on the dequantized experts: to 16-bit rounding with the inputs 16-bit; with the
    inputs as codes, as the model runs them, within their e4m3 rounding (~3.6% rms a
    value, two products in a row: over 5% at one token seen on an H200, bound 10%)."""
    router, gate_up, down = experts_layer(blocks, dtype, 8, num_tokens)
    hidden, _ = SHAPES[blocks]
    h = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3))
    h = h.to(dtype).to(DEVICE)
    ref = moe_ref(h, router, gate_up.dequantize(), down.dequantize(), top_k, True)
    coded = moe.fused_moe(h, router, gate_up, down, top_k=top_k, normalize=True)
    assert rel_err(coded, ref) < 0.1
    monkeypatch.setattr(moe, "FP8_CODES_ROWS", 1 << 30)  # the inputs as they are
    out = moe.fused_moe(h, router, gate_up, down, top_k=top_k, normalize=True)
    assert rel_err(out, ref) < 4 * TOLERANCE[dtype]
    if num_tokens == 1:  # the one-token path: RMSNorm(h) with a unit weight is h / rms
        count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        ones = torch.ones(hidden, dtype=dtype, device=DEVICE)
        vector = moe_vector.experts_vector(
            h, Norm(ones, 0.0), router, gate_up, down, top_k=top_k, normalize=True, count=count
        )
        normed = h.float() * torch.rsqrt(h.float().pow(2).mean())
        normed_ref = moe_ref(normed, router, gate_up.dequantize(), down.dequantize(), top_k, True)
        assert rel_err(vector, normed_ref) < 4 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", BLOCKS, ids=IDS)
@pytest.mark.parametrize("tiles", [None, (4, 64, 4, 2)], ids=["default", "narrow"])
def test_one_tokens_fp8_products_are_each_experts(
    dtype: torch.dtype, blocks: tuple[int, int] | None, tiles: tuple[int, int, int, int] | None
) -> None:
    """vector_gemv's experts (gate|up, no activation) and mix_down, row by row against
    each chosen expert's dequantized weights."""
    _, gate_up, down = experts_layer(blocks, dtype, 5, 7)
    hidden, inter = SHAPES[blocks]
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)
    chosen = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEVICE)
    rows = vector_gemv(x, gate_up, experts=chosen, tiles=tiles)
    dense_gate_up, dense_down = gate_up.dequantize().cpu(), down.dequantize().cpu()
    for c, e in enumerate(chosen.tolist()):
        assert rel_err(rows[c].cpu(), dense_gate_up[e] @ x[0].float().cpu()) < TOLERANCE[dtype]
    act = torch.randn(3, inter, generator=gen).to(dtype).to(DEVICE)
    weights = torch.tensor([0.5, 0.3, 0.2], device=DEVICE)
    mixed = moe_vector.mix_down(act, down, chosen, weights, tiles)
    ref = sum(
        w * (dense_down[e] @ a.float().cpu())
        for w, e, a in zip(weights.tolist(), chosen.tolist(), act, strict=True)
    )
    assert isinstance(ref, Tensor) and rel_err(mixed[0].cpu(), ref) < 2 * TOLERANCE[dtype]


def test_fp8_codes_go_to_experts_only() -> None:
    codes = fp8_experts((2, 128, 128), None, torch.float16, 0)
    x = torch.zeros(1, 128, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="experts only"):
        vector_gemv(x, codes)


def experts_checkpoint(base: Path, tmp_path: Path, stacked: bool) -> tuple[Path, dict[str, Tensor]]:
    """`base` (moe_dir's checkpoint), or (`stacked`) a copy with layer 0's four experts
    stacked as transformers 5 keeps them in memory; and their gate_proj, up_proj and
    down_proj weights stacked [E, N, K]."""
    tensors = load_file(str(base / "model.safetensors"))
    prefix = "model.layers.0.mlp.experts"
    names = ("gate_proj", "up_proj", "down_proj")
    per_expert = {
        p: torch.stack([tensors[f"{prefix}.{j}.{p}.weight"] for j in range(4)]) for p in names
    }
    if not stacked:
        return base, per_expert
    model = tmp_path / "stacked"
    shutil.copytree(base, model)
    for j, p in itertools.product(range(4), names):
        del tensors[f"{prefix}.{j}.{p}.weight"]
    tensors[f"{prefix}.gate_up_proj"] = torch.cat(
        [per_expert["gate_proj"], per_expert["up_proj"]], 1
    )
    tensors[f"{prefix}.down_proj"] = per_expert["down_proj"]
    save_file(tensors, str(model / "model.safetensors"))
    return model, per_expert


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_fp8_at_load_quantizes_each_expert_per_row(
    moe_dir: Path,  # noqa: F811  (the fixture)
    tmp_path: Path,
    stacked: bool,
) -> None:
    """--quantization fp8 on a 16-bit MoE checkpoint: each expert's projections become FP8
    with a scale a row, exactly Fp8Weight.quantize of its 16-bit rows, whether the
    checkpoint holds the experts one by one or stacked (transformers 5's in-memory form)."""
    model, per_expert = experts_checkpoint(moe_dir, tmp_path, stacked)
    config = TurboConfig.load(model)
    weights = load_weights(model, config, CPU, torch.bfloat16, QuantScheme("fp8", "load"))
    experts = weights.layers[0].experts
    assert experts is not None and isinstance(experts.gate_up, Fp8Experts)
    assert isinstance(experts.down, Fp8Experts) and experts.down.block_size is None
    assert experts.gate_up.nbytes == 4 * 512 * 256 + 4 * 512 * 4  # codes and a scale a row
    for j in range(4):
        gate_up = torch.cat([per_expert["gate_proj"][j], per_expert["up_proj"][j]])
        for got, rows in ((experts.gate_up, gate_up), (experts.down, per_expert["down_proj"][j])):
            want = Fp8Weight.quantize(rows.to(torch.bfloat16), torch.bfloat16)
            assert torch.equal(
                got.expert(j).weight.view(torch.uint8), want.weight.view(torch.uint8)
            )
            assert torch.equal(got.expert(j).scale, want.scale)


@pytest.mark.parametrize("blocks", BLOCKS, ids=IDS)
def test_fp8_codes_in_and_out_of_the_grouped_gemm(
    monkeypatch: pytest.MonkeyPatch, blocks: tuple[int, int] | None
) -> None:
    """From FP8_CODES_ROWS rows a block the inputs are quantized too (per token against a
    scale a row, per 128-group against blocks): each product is then the float32 product
    of the inputs' codes times their scales with the dequantized experts, and the layer
    stays within e4m3's rounding of the inputs (~2^-4 a value) of the 16-bit-input one."""
    monkeypatch.setattr(moe, "FP8_CODES_ROWS", 16)  # every block, at these sizes
    dtype = DTYPES[0]
    router, gate_up, down = experts_layer(blocks, dtype, 4, 11)
    hidden, _ = SHAPES[blocks]
    gen = torch.Generator().manual_seed(12)
    h = torch.randn(20, hidden, generator=gen).to(dtype).to(DEVICE)
    experts = torch.randint(0, 4, (20, 2), generator=gen).to(DEVICE)
    layout = moe_align.align(experts, 4, 16)
    codes, scale = moe.fp8_input(h, gate_up, 16)
    assert scale is not None and codes.dtype == torch.float8_e4m3fn
    group = None if blocks is None else 128
    ref_codes, ref_scale = quantize_per_token_ref(h, group)
    assert torch.equal(codes[:20].view(torch.uint8).cpu(), ref_codes.view(torch.uint8).cpu())
    out = moe.grouped_gemm(codes, gate_up, *layout, num_pairs=40, a_row_div=2, block_m=16,
                           a_scale=scale)  # fmt: skip
    width = group or hidden
    x = (ref_codes.float().view(20, -1, width) * ref_scale[:, :, None]).view(20, hidden)
    dense, flat = gate_up.dequantize().cpu(), experts.flatten().cpu()
    ref = torch.stack([dense[int(flat[p])] @ x[p // 2].cpu() for p in range(40)])
    assert out.dtype == dtype and rel_err(out.cpu(), ref) < TOLERANCE[dtype]
    coded = moe.fused_moe(h, router, gate_up, down, top_k=2, normalize=True)
    monkeypatch.setattr(moe, "FP8_CODES_ROWS", 1 << 30)
    widened = moe.fused_moe(h, router, gate_up, down, top_k=2, normalize=True)
    assert 0 < rel_err(coded, widened) < 0.1
    with pytest.raises(ValueError, match="codes for a against FP8 experts only"):
        moe.grouped_gemm(codes, gate_up.dequantize().to(dtype), *layout, num_pairs=40,
                         a_row_div=2, block_m=16, a_scale=scale)  # fmt: skip


def test_block_experts_off_whole_blocks_are_refused_in_one_line(tmp_path: Path) -> None:
    """A block-scaled checkpoint whose experts' width (here 192) is no whole number of
    128-row blocks cannot stack gate | up by blocks: refused in one line, naming it."""
    shape = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 192}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32}  # k: 128 rows
    config = Qwen3MoeConfig(**(TINY_SHAPE | shape | heads | {"hidden_size": 128}))
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "base")
    model = tmp_path / "fp8"
    write_checkpoint(tmp_path / "base", model, FORMATS["fp8"], "fp8")
    scheme = read_scheme(json.loads((model / "config.json").read_text()), None)
    with pytest.raises(UnsupportedModel, match=r"experts\.0\.gate_proj: .*not a multiple of 128"):
        load_weights(model, TurboConfig.load(model), CPU, torch.bfloat16, scheme)
