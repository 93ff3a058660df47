"""oneDNN-packed and fused linear layers (engine/torch_backend/linear.py) against nn.Linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.torch_backend import TorchBackend, native_cpu
from lmd.engine.torch_backend.linear import (
    PANEL_ROWS,
    FusedLinear,
    FusedPart,
    PackedLinear,
    PackedWeight,
    can_pack,
    pack_linears,
)
from tests.models import TINY_SHAPE, random_prompts, save_tiny_llama

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not can_pack(CPU, torch.float32), reason="this torch has no oneDNN linear"
)


def linear(n_in: int, n_out: int, *, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias).requires_grad_(False)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear(bias: bool) -> None:
    stock = linear(48, 80, bias=bias, seed=0)
    packed = PackedLinear(stock)
    x = torch.randn(1, 7, 48)
    strided = torch.randn(1, 7, 60)[..., :48]  # a slice, as fused parts hand out
    for inp in (x, x[0], strided):
        torch.testing.assert_close(packed(inp), stock(inp), rtol=1e-5, atol=1e-5)
    assert packed(x[:, :0]).shape == (1, 0, 80)


@pytest.mark.parametrize("threads", [1, 2])
def test_both_forms_of_a_packed_weight_compute_the_linear(threads: int) -> None:
    """Every row count from 1 past PANEL_ROWS (panel_gemm up to it, oneDNN after), outputs
    off the panels' 8, a bias, on one thread and on two."""
    stock = linear(70, 43, bias=True, seed=3)
    weight = PackedWeight(stock.weight)
    if native_cpu.supported():
        assert weight.panels is not None and weight.panels.shape == (6, 70, 8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, PANEL_ROWS + 2):
            x = torch.randn(rows, 70)
            expected = torch.nn.functional.linear(
                x.double(), stock.weight.double(), stock.bias.double()
            )
            torch.testing.assert_close(
                weight.linear(x, stock.bias), expected.float(), rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(
                weight.linear(x, None),
                (expected - stock.bias.double()).float(),
                rtol=1e-5,
                atol=1e-5,
            )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_parts_match_their_linears(bias: bool) -> None:
    stock = [linear(32, n, bias=bias, seed=i) for i, n in enumerate((40, 16, 16))]
    fused = FusedLinear(stock)
    parts = [FusedPart(fused, i, lin) for i, lin in enumerate(stock)]
    x = torch.randn(1, 5, 32)
    for part, lin in zip(parts, stock, strict=True):
        torch.testing.assert_close(part(x), lin(x), rtol=1e-5, atol=1e-5)


def test_fused_part_never_returns_a_stale_slice() -> None:
    stock = [linear(32, 24, bias=False, seed=i) for i in range(2)]
    fused = FusedLinear(stock)
    gate, up = (FusedPart(fused, i, lin) for i, lin in enumerate(stock))
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    gate(x)
    # Another input before `up` took its slice of x: computed for y, not taken from x.
    torch.testing.assert_close(up(y), stock[1](y), rtol=1e-5, atol=1e-5)
    # The same part twice on one input computes again rather than reusing.
    torch.testing.assert_close(gate(y), stock[0](y), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gate(y), stock[0](y), rtol=1e-5, atol=1e-5)
    up(y)  # every part served: the shared output is let go
    assert not fused.holds_output


def test_pack_linears_fuses_siblings_and_packs_the_rest(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path), dtype=torch.float32)
    ids = torch.tensor([random_prompts([9], 512, seed=1)[0]])
    with torch.inference_mode():
        before = model(ids).logits
        # 2 layers: q/k/v and gate/up fused; o_proj, down_proj and lm_head alone.
        assert pack_linears(model) == (10, 5)
        after = model(ids).logits
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.k_proj, FusedPart)
    assert isinstance(layer.mlp.down_proj, PackedLinear)
    assert not any(type(m) is nn.Linear for m in model.modules())
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_a_bf16_weight_runs_prompt_gemms_in_bf16_and_decode_rows_in_fp32() -> None:
    """More than PANEL_ROWS rows: oneDNN on the bf16-rounded input and weight, summed in
    fp32, the bias added in fp32. Decode rows: panel_gemm in fp32, as without bf16."""
    stock = linear(96, 72, bias=True, seed=5)
    fp32, bf16 = PackedWeight(stock.weight), PackedWeight(stock.weight, bf16=True)
    x = torch.randn(PANEL_ROWS + 9, 96)
    product = x.bfloat16().double() @ stock.weight.bfloat16().double().T
    got = bf16.linear(x, stock.bias)
    assert got.dtype == torch.float32
    rounding = float(product.abs().max()) * 2**-8  # the product's own bf16 rounding
    torch.testing.assert_close(got.double(), product + stock.bias, rtol=0, atol=rounding)
    assert not torch.equal(got, fp32.linear(x, stock.bias))  # not the fp32 GEMM
    if native_cpu.supported():
        rows = x[:PANEL_ROWS]
        assert torch.equal(bf16.linear(rows, stock.bias), fp32.linear(rows, stock.bias))


@pytest.mark.parametrize("matmul", ["float32", "bfloat16", "auto"])
def test_the_backend_packs_in_its_cpu_matmul_dtype(tmp_path: Path, matmul: str) -> None:
    backend = TorchBackend(save_tiny_llama(tmp_path), CPU, torch.float32, cpu_matmul_dtype=matmul)
    bf16 = matmul == "bfloat16" or (matmul == "auto" and native_cpu.has_bf16_dot())
    layer = backend.model.model.layers[0]
    assert layer.mlp.down_proj.packed_weight.bf16 is bf16
    assert layer.self_attn.q_proj.fused.packed_weight.bf16 is bf16


@pytest.mark.parametrize(("matmul", "tolerance"), [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_qkv_bias_model_agrees_with_transformers(
    tmp_path: Path, matmul: str, tolerance: float
) -> None:
    """19 prompt rows: oneDNN's GEMMs, in the dtype asked; fp32 agrees with transformers
    to rounding order, bf16 to its rounding."""
    torch.manual_seed(0)
    config = Qwen2Config(
        **TINY_SHAPE,
        max_position_embeddings=256,
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    backend = TorchBackend(tmp_path, CPU, torch.float32, cpu_matmul_dtype=matmul)
    assert backend.model.model.layers[0].self_attn.q_proj.fused.bias is not None
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    prompts = random_prompts([6, 13], 512, seed=7)
    kv = torch.zeros(backend.kv_cache_shape(8, 4))
    batch = ForwardBatch.pack(prompts, [0, 0], [[0, 1], [2, 3, 4, 5]], 4)
    ours = backend.forward(batch, kv)
    with torch.inference_mode():
        for prompt, row in zip(prompts, ours, strict=True):
            theirs = ref(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(row, theirs, rtol=tolerance, atol=tolerance)
            if matmul == "float32":
                assert int(row.argmax()) == int(theirs.argmax())
