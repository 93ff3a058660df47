"""4-bit experts (quant/w4a16_experts.py) in kernels/moe.py: the grouped GEMM and a layer
of experts (with one token too, which takes that path for them) against the same math in
float32 on the dequantized experts, in groups of 128 and of 64; and the loading:
`--quantization w4a16` rounds each expert as W4A16Weight.quantize does (one by one or
stacked), an AWQ checkpoint's experts stay its words, while an act-order checkpoint's and
widths off 128 stay 16-bit and say so. Through Triton's interpreter without CUDA
(float16: the interpreter's dots take no bfloat16).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import DEVICE, ON_CUDA, TOLERANCE, rel_err

pytest.importorskip("triton")

from lmd.engine.turbo.backend import TurboBackend
from lmd.engine.turbo.config import TurboConfig
from lmd.engine.turbo.kernels import Norm, moe, moe_align, moe_vector, w4a16_rows
from lmd.engine.turbo.kernels.w4a16_dense import dequantize_experts
from lmd.engine.turbo.quant.scheme import QuantScheme, four_bit_experts
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts
from lmd.engine.turbo.weights import load_weights
from tests.models import TINY_SHAPE
from tests.unit.test_turbo_fp8_experts import assert_grouped_gemms, experts_checkpoint
from tests.unit.test_turbo_moe import moe_ref
from tests.unit.test_turbo_quant_checkpoints import moe_dir  # noqa: F401  (a fixture)

CPU = torch.device("cpu")
DTYPES = [torch.float16, torch.bfloat16] if ON_CUDA else [torch.float16]
DTYPE = torch.float16 if ON_CUDA else torch.float32  # a backend's
HIDDEN, INTER = 256, 128  # gate|up's K two blocks of 128, down's one


def four_bit(
    shape: tuple[int, int, int], group: int, dtype: torch.dtype, seed: int
) -> W4A16Experts:
    """E random experts of [N, K], each its own range, rounded to 4 bits one by one."""
    e, n, k = shape
    gen = torch.Generator().manual_seed(seed)
    ranges = torch.arange(1, e + 1)[:, None, None] / 8
    return W4A16Experts.quantize((torch.randn(e, n, k, generator=gen) * ranges).to(dtype), group)


def on_device(experts: W4A16Experts) -> W4A16Experts:
    return W4A16Experts(
        experts.qweight.to(DEVICE), experts.scales.to(DEVICE), experts.zeros.to(DEVICE),
        experts.group_size,
    )  # fmt: skip


def test_experts_hold_their_parts_words() -> None:
    part = W4A16Weight.quantize(torch.randn(128, 256, dtype=torch.float16))
    experts = W4A16Experts.empty((2, 256, 256), 128, torch.float16, CPU)
    experts.put(1, 128, part)  # up's outputs of an expert whose gate is outputs 0..127
    assert torch.equal(experts.expert(1).dequantize()[128:], part.dequantize())
    assert experts.shape == (2, 256, 256) and experts.dtype == torch.float16
    assert experts.nbytes == 2 * (256 * 256 // 2 + 2 * 256 * 2 + 2 * 256)
    ordered = W4A16Weight(part.qweight, part.scales, part.zeros, perm=torch.arange(256))
    with pytest.raises(ValueError, match="act order: True"):
        experts.put(0, 0, ordered)
    with pytest.raises(ValueError, match="in groups of 64"):
        experts.put(0, 0, W4A16Weight.quantize(torch.randn(128, 256), 64))
    with pytest.raises(ValueError, match="not a multiple of 128"):
        W4A16Experts.empty((2, 256, 96), 128, torch.float16, CPU)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("num_tokens", [3, 70, 150])
@pytest.mark.parametrize("scale_after", [32, 0], ids=["decode-form", "block-weights"])
def test_the_grouped_gemm_of_w4a16_experts_is_their_meaning(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    group: int,
    num_tokens: int,
    scale_after: int,
) -> None:
    """gate|up's and down's products against float32 products with the dequantized
    experts, in 16-, 32- and 64-row blocks (3, 70 and 150 tokens over 4 experts), each
    128 inputs' products in either form (moe.W4_SCALE_AFTER_ROWS)."""
    monkeypatch.setattr(moe, "W4_SCALE_AFTER_ROWS", scale_after)
    gate_up = on_device(four_bit((4, 2 * INTER, HIDDEN), group, dtype, num_tokens))
    down = on_device(four_bit((4, HIDDEN, INTER), group, dtype, num_tokens + 1))
    assert_grouped_gemms(gate_up, down, (HIDDEN, INTER), dtype, num_tokens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 2), (40, 2), (9, 4), (300, 2)])
def test_a_layer_of_w4a16_experts_equals_the_loop(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, num_tokens: int, top_k: int
) -> None:
    """fused_moe (gate|up with its SiLU, the routing weights, the sum over k) against
    transformers' loop on the dequantized experts; 300 tokens in 64-row blocks, which
    multiply dequantized slabs from moe.W4_DEQUANT_ROWS (here 64)."""
    monkeypatch.setattr(moe, "W4_DEQUANT_ROWS", 64)
    gen = torch.Generator().manual_seed(num_tokens)
    router = torch.randn(8, HIDDEN, generator=gen).to(dtype).to(DEVICE)
    gate_up = on_device(four_bit((8, 2 * INTER, HIDDEN), 128, dtype, 1))
    down = on_device(four_bit((8, HIDDEN, INTER), 128, dtype, 2))
    h = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype).to(DEVICE)
    ref = moe_ref(h, router, gate_up.dequantize(), down.dequantize(), top_k, True)
    out = moe.fused_moe(h, router, gate_up, down, top_k=top_k, normalize=True)
    assert rel_err(out, ref) < 4 * TOLERANCE[dtype]
    with pytest.raises(ValueError, match="against experts in"):
        moe.fused_moe(h.float(), router.float(), gate_up, down, top_k=top_k, normalize=True)


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_w4a16_at_load_rounds_each_expert(
    moe_dir: Path,  # noqa: F811  (the fixture)
    tmp_path: Path,
    stacked: bool,
) -> None:
    """--quantization w4a16 on a 16-bit MoE checkpoint: each expert's projections become
    exactly W4A16Weight.quantize of its 16-bit rows (gate | up as one weight), whether
    the checkpoint holds the experts one by one or stacked; the model says so."""
    model, per_expert = experts_checkpoint(moe_dir, tmp_path, stacked)
    scheme = QuantScheme("w4a16", "load")
    weights = load_weights(model, TurboConfig.load(model), CPU, torch.bfloat16, scheme)
    experts = weights.layers[0].experts
    assert experts is not None
    assert isinstance(experts.gate_up, W4A16Experts) and isinstance(experts.down, W4A16Experts)
    assert experts.gate_up.nbytes == 4 * (512 * 256 // 2 + 2 * 512 * 2 + 2 * 512)
    for j in range(4):
        gate_up = torch.cat([per_expert["gate_proj"][j], per_expert["up_proj"][j]])
        for got, rows in ((experts.gate_up, gate_up), (experts.down, per_expert["down_proj"][j])):
            want, mine = W4A16Weight.quantize(rows.to(torch.bfloat16)), got.expert(j)
            assert torch.equal(mine.qweight, want.qweight) and torch.equal(mine.zeros, want.zeros)
            assert torch.equal(mine.scales, want.scales)
    turbo = TurboBackend(
        model, DEVICE, torch.float16 if ON_CUDA else torch.float32, quantization="w4a16"
    )
    assert turbo.quantization == "w4a16 (round to nearest at load, group 128)"


def test_four_bit_experts_where_the_scheme_and_the_widths_allow(
    moe_dir: Path,  # noqa: F811  (the fixture)
) -> None:
    """Hidden and the experts' width (256 each here) whole blocks of 128 and of the
    groups, groups that divide 128 or are whole blocks of it, no act order."""
    config = TurboConfig.load(moe_dir)
    w4 = QuantScheme("w4a16", "load")
    assert four_bit_experts(w4, config) and four_bit_experts(replace(w4, group_size=64), config)
    assert not four_bit_experts(replace(w4, act_order=True), config)
    assert not four_bit_experts(replace(w4, group_size=96), config)
    assert not four_bit_experts(replace(w4, group_size=512), config)
    assert not four_bit_experts(QuantScheme("fp8", "load"), config)
    assert config.moe is not None
    narrow = replace(config, moe=replace(config.moe, intermediate_size=192))
    assert not four_bit_experts(w4, narrow)


def test_experts_off_128_stay_sixteen_bit_and_say_so(tmp_path: Path) -> None:
    """--quantization w4a16 on experts 96 wide (down's K no whole block of 128; a
    checkpoint's are whole groups): they stay 16-bit, and the backend says so."""
    shape = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 96}
    config = Qwen3MoeConfig(**(TINY_SHAPE | shape | {"hidden_size": 128, "head_dim": 32}))
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    scheme = QuantScheme("w4a16", "load")
    weights = load_weights(tmp_path, TurboConfig.load(tmp_path), CPU, torch.float32, scheme)
    experts = weights.layers[0].experts
    assert experts is not None and isinstance(experts.gate_up, Tensor)
    assert isinstance(weights.layers[0].qkv, W4A16Weight)
    turbo = TurboBackend(tmp_path, DEVICE, DTYPE, quantization="w4a16")
    assert turbo.quantization == "w4a16 (round to nearest at load, group 128); experts 16-bit"


def test_blocks_of_eight_rows_are_the_native_kernels_alone() -> None:
    """8-row blocks for up to 2 pairs an expert where the native experts kernel takes both
    layers of experts (a GPU; kernels/w4a16_rows.py), 64-row ones past 16 where the wgmma
    kernel does (Hopper), and the grouped GEMM refuses 8 rows otherwise (tl.dot takes 16
    rows and more)."""
    assert moe_align.block_rows(8, 128) == 16
    assert moe_align.block_rows(8 * 32, 128, native=(8, 16)) == 8
    assert moe_align.block_rows(8 * 64, 128, native=(8, 16)) == 16
    assert moe_align.block_rows(8 * 300, 128, native=(8, 16)) == 32
    assert moe_align.block_rows(8 * 4096, 128, native=(8, 16)) == 128
    assert moe_align.block_rows(8 * 64, 128, native=(8, 16, 64)) == 16  # 4 pairs an expert
    assert moe_align.block_rows(8 * 80, 128, native=(8, 16, 64)) == 64  # 5
    assert moe_align.block_rows(8 * 300, 128, native=(8, 16, 64)) == 64
    assert moe_align.block_rows(8 * 4096, 128, native=(8, 16, 64)) == 64
    gate_up = on_device(four_bit((4, 2 * INTER, HIDDEN), 128, torch.float16, 1))
    down = on_device(four_bit((4, HIDDEN, INTER), 128, torch.float16, 2))
    h = torch.randn(3, HIDDEN).to(torch.float16).to(DEVICE)
    assert bool(moe_align.native_blocks(h, gate_up, down)) == ON_CUDA
    if not ON_CUDA:
        sorted_pairs, block_expert = moe_align.align(torch.zeros(3, 2, dtype=torch.int32), 4, 8)
        with pytest.raises(ValueError, match="blocks of 8 rows take the native W4A16 kernel"):
            moe.grouped_gemm(h, gate_up, sorted_pairs, block_expert, num_pairs=6, a_row_div=2,
                             block_m=8)  # fmt: skip


@pytest.mark.parametrize("per_slab", [1, 3])
def test_large_blocks_multiply_dequantized_slabs(
    monkeypatch: pytest.MonkeyPatch, per_slab: int
) -> None:
    """From moe.W4_DEQUANT_ROWS rows a block (here 64), slabs of `per_slab` experts (4
    and 2 slabs of the 4) made 16-bit by dequantize_experts, each slab's blocks
    multiplied apart: their meaning still (150 tokens, 64-row blocks); and
    dequantize_experts is each expert's W4A16Weight.dequantize."""
    gate_up = on_device(four_bit((4, 2 * INTER, HIDDEN), 128, DTYPE, 5))
    down = on_device(four_bit((4, HIDDEN, INTER), 128, DTYPE, 6))
    monkeypatch.setattr(moe, "SLAB_BYTES", per_slab * 2 * INTER * HIDDEN * DTYPE.itemsize)
    monkeypatch.setattr(moe, "W4_DEQUANT_ROWS", 64)  # 64-row blocks: the interpreter's pace
    monkeypatch.setattr(w4a16_rows, "WGMMA_EXPERTS", False)  # on Hopper it would take them
    assert moe_align.block_rows(150 * 2, 4) == 64
    assert_grouped_gemms(gate_up, down, (HIDDEN, INTER), DTYPE, 150)
    slab = dequantize_experts(down.qweight, down.scales, down.zeros, 128, lo=1, hi=3)
    expected = down.dequantize()[1:3].to(DTYPE)  # [2, HIDDEN, INTER]
    assert slab.dtype == DTYPE and torch.equal(slab.cpu(), expected.cpu())


def test_one_token_takes_both_layers_4_bit_or_neither() -> None:
    """moe_vector.experts_vector's 4-bit branch (the router's launch, then the native
    kernel: tests/gpu/test_w4a16_experts_gpu.py) refuses one layer 4-bit and one not."""
    gate_up = on_device(four_bit((4, 2 * INTER, HIDDEN), 128, DTYPE, 7))
    down = torch.randn(4, HIDDEN, INTER, dtype=DTYPE, device=DEVICE)
    hidden = torch.randn(1, HIDDEN, dtype=DTYPE, device=DEVICE)
    norm = Norm(torch.ones(HIDDEN, dtype=DTYPE, device=DEVICE), 1e-6)
    router = torch.randn(4, HIDDEN, dtype=DTYPE, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="both layers of experts 4-bit or neither"):
        moe_vector.experts_vector(hidden, norm, router, gate_up, down, top_k=2, normalize=True,
                                  count=count)  # fmt: skip
