"""FP8 weights (quant/fp8.py) and their kernels (kernels/fp8.py) on CPU.

Triton's interpreter runs float8_e4m3fn tensors and tl.dot on them (as fp16 products in
numpy), so the activation quantizers and the Triton GEMM run here as on a GPU; only
torch._scaled_mm, the per-channel GEMM on Hopper, is left to tests/gpu/test_fp8_gpu.py.
Fp8Weight.matmul itself refuses the CPU (fp8_supported).

Error bound of e4m3 (3 mantissa bits, ties to even): a value v of magnitude >= 2^-6 (in
units of its scale) is stored within 2^-4 |v| (half the spacing 2^(e-3) of its binade
[2^e, 2^(e+1))); below 2^-6 the codes are subnormal, multiples of 2^-9, within 2^-10.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import DEVICE, ON_CUDA, rel_err

pytest.importorskip("triton")

from lmd.engine.turbo.kernels import activation as activation_kernels
from lmd.engine.turbo.kernels import fp8 as fp8_kernels
from lmd.engine.turbo.kernels import fp8_quant
from lmd.engine.turbo.kernels.norm import rms_norm, rms_norm_fp8
from lmd.engine.turbo.quant.e4m3 import FP8_MAX
from lmd.engine.turbo.quant.fp8 import (
    Fp8Rows,
    Fp8Weight,
    fp8_supported,
    quantize_per_token_ref,
)

# The output is rounded once to its dtype (2^-9 bf16, 2^-12 fp16 relative: ~0.6 of that
# in norm); the rest is float32 sums in another order, and on the 16-bit path W's tiles
# rounded to x's dtype after their block scale (as much again).
OUT_TOLERANCE = {torch.bfloat16: 4e-3, torch.float16: 1e-3}


def e4m3_values() -> Tensor:
    """Every e4m3fn value >= 0, float32, ascending (codes 0x00-0x7E; 0x7F is NaN)."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def error_bound(w: Tensor, scale: Tensor) -> Tensor:
    """The largest |dequantized - w| e4m3 allows, element-wise (module docstring)."""
    return torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10)


def dequantized_x(x: Tensor, group: int | None) -> Tensor:
    """x [M, K] as the per-token quantizer stores it, back in float32."""
    codes, scale = quantize_per_token_ref(x, group)
    width = group or x.shape[1]
    return codes.float() * scale.repeat_interleave(width, dim=1)[:, : x.shape[1]]


def matmul_ref(x: Tensor, fw: Fp8Weight, bias: Tensor | None = None) -> Tensor:
    """float32 math on what fp8_matmul multiplies: x as quantized per token (16-bit x as
    it is up to SMALL_ROWS rows) by the dequantized W."""
    if x.shape[0] <= fp8_kernels.SMALL_ROWS:
        xf = x.float()
    else:
        xf = dequantized_x(x, 128 if fw.block_size else None)
    y = xf @ fw.dequantize().t()
    return y if bias is None else y + bias.float()


def check_codes(q: Tensor, ref_q: Tensor) -> None:
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.float(), ref_q.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_is_within_e4m3s_bound(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 300) * torch.logspace(-6, 3, 96)[:, None]  # rows of every magnitude
    w[5] = 0.0
    w[7, :10] = 1e-9  # subnormal in its row's units
    w = w.to(dtype)
    fw = Fp8Weight.quantize(w, dtype)
    assert fw.shape == (96, 300) and fw.block_size is None and fw.scale.shape == (96,)
    assert fw.nbytes == 96 * 300 + 96 * 4 and fw.device == w.device
    err = (fw.dequantize() - w.float()).abs()
    assert (err <= error_bound(w.float(), fw.scale[:, None])).all()
    amax = fw.weight.float().abs().amax(dim=1)
    assert (amax[torch.arange(96) != 5] == FP8_MAX).all()  # each row's largest is 448
    assert fw.scale[5] > 0 and (fw.weight[5].float() == 0).all()


def test_block_quantize_is_within_bound_per_block() -> None:
    torch.manual_seed(1)
    w = torch.randn(300, 200) * torch.logspace(-3, 2, 300)[:, None]
    fw = Fp8Weight.quantize(w.to(torch.bfloat16), torch.bfloat16, (128, 128))
    assert fw.block_size == (128, 128) and fw.scale.shape == (3, 2)
    per_elem = fw.scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    w = w.to(torch.bfloat16).float()
    assert ((fw.dequantize() - w).abs() <= error_bound(w, per_elem)).all()


def test_round_to_e4m3_matches_torch_on_every_value_and_tie() -> None:
    """The kernels' own rounding: every code, every midpoint (ties to even), just off the
    midpoints, beyond 448 (saturates), subnormals. One row with absmax 448: scale 1."""
    values = e4m3_values()
    mids = (values[1:] + values[:-1]) / 2
    row = torch.cat([values, mids, mids.nextafter(values[1:]), mids.nextafter(values[:-1])])
    row = torch.cat([row, torch.tensor([127.99, 464.0, 2.0**-10, 3 * 2.0**-11, 1e-30])])
    row = torch.cat([row, -row]).clamp(-FP8_MAX, FP8_MAX)
    x = row[None, :].to(DEVICE)  # float32
    q, s = fp8_quant.quantize_per_token(x)
    assert float(s) == 1.0
    check_codes(q, row.to(torch.float8_e4m3fn)[None].to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k"), [(1, 128), (19, 300), (3, 5000)])
def test_activation_quantizers_match_the_torch_reference(m: int, k: int, dtype) -> None:
    torch.manual_seed(m * k)
    x = (torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]).to(dtype).to(DEVICE)
    x[0, :] = 0.0  # an all-zero row: a tiny positive scale, codes 0
    q, s = fp8_quant.quantize_per_token(x)
    ref_q, ref_s = quantize_per_token_ref(x)
    assert s.shape == (m, 1) and torch.equal(s, ref_s) and float(s[0]) > 0
    check_codes(q, ref_q)
    q, s = fp8_quant.quantize_per_token_group(x)
    ref_q, ref_s = quantize_per_token_ref(x, 128)
    assert s.shape == (m, -(-k // 128)) and torch.equal(s, ref_s)
    assert s.stride(0) == 1  # column-major: one K group's scales are contiguous
    check_codes(q, ref_q)
    x_back = dequantized_x(x, 128)
    assert ((x_back - x.float()).abs() <= error_bound(x.float(), ref_s.max())).all()
    q, s = fp8_quant.quantize_per_token_group(x, 4)  # zero rows up to a multiple of 4
    rows = -(-m // 4) * 4
    assert q.shape == (rows, k) and s.shape == (rows, -(-k // 128)) and s.stride() == (1, rows)
    check_codes(q[:m], ref_q)
    assert torch.equal(s[:m], ref_s) and not q[m:].float().any()


def test_from_checkpoint_block_scale_convention() -> None:
    """weight_scale_inv multiplies: W = codes * scale of the 128x128 block."""
    codes = torch.full((200, 300), 1.5).to(torch.float8_e4m3fn)
    codes[0, 0] = -448.0
    scale_inv = torch.tensor([[2.0, 3.0, 5.0], [7.0, 11.0, 13.0]], dtype=torch.bfloat16)
    fw = Fp8Weight.from_checkpoint(codes, scale_inv, [128, 128], torch.bfloat16)
    assert fw.scale.dtype == torch.float32 and fw.block_size == (128, 128)
    w = fw.dequantize()
    assert float(w[0, 0]) == -448.0 * 2
    assert float(w[127, 255]) == 1.5 * 3 and float(w[127, 256]) == 1.5 * 5
    assert float(w[128, 0]) == 1.5 * 7
    assert float(w[199, 299]) == 1.5 * 13 and float(w[150, 130]) == 1.5 * 11


@pytest.mark.parametrize("scale_shape", [(200,), (200, 1), (), (1,)])
def test_from_checkpoint_per_channel_and_per_tensor(scale_shape: tuple[int, ...]) -> None:
    codes = torch.full((200, 64), 2.0).to(torch.float8_e4m3fn)
    scale = torch.full(scale_shape, 0.25) if scale_shape in ((), (1,)) else torch.rand(200)
    fw = Fp8Weight.from_checkpoint(codes, scale.reshape(scale_shape), None, torch.float16)
    assert fw.scale.shape == (200,) and fw.scale.is_contiguous()
    assert torch.equal(fw.dequantize(), 2.0 * fw.scale[:, None].expand(200, 64))
    assert torch.equal(fw.scale, scale.reshape(-1).expand(200))


@pytest.mark.parametrize(
    ("weight", "scale", "block", "message"),
    [
        (torch.zeros(8, 8, dtype=torch.bfloat16), torch.ones(8), None, "float8_e4m3fn"),
        (torch.zeros(8, dtype=torch.float8_e4m3fn), torch.ones(8), None, "float8_e4m3fn"),
        (torch.zeros(8, 8, dtype=torch.float8_e4m3fn), torch.ones(7), None, "per-channel"),
        (torch.zeros(8, 8, dtype=torch.float8_e4m3fn), torch.ones(8, 2), None, "per-channel"),
        (torch.zeros(8, 8, dtype=torch.float8_e4m3fn), torch.ones(8, dtype=torch.int32), None,
         "float tensor"),
        (torch.zeros(256, 130, dtype=torch.float8_e4m3fn), torch.ones(2, 1), (128, 128),
         r"is \[2, 2\]"),
        (torch.zeros(64, 64, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (64, 64), "128, 128"),
    ],
)  # fmt: skip
def test_from_checkpoint_rejects_wrong_shapes_and_dtypes(weight, scale, block, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        Fp8Weight.from_checkpoint(weight, scale, block, torch.bfloat16)
    assert "\n" not in str(info.value)


def test_cat_fuses_along_n() -> None:
    torch.manual_seed(2)
    q, k, v = (torch.randn(n, 256) for n in (256, 128, 128))
    for block in (None, (128, 128)):
        parts = [Fp8Weight.quantize(t, torch.bfloat16, block) for t in (q, k, v)]
        fused = Fp8Weight.cat(parts)
        assert fused.shape == (512, 256) and fused.block_size == block
        assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    odd = Fp8Weight.quantize(torch.randn(200, 256), torch.bfloat16, (128, 128))
    with pytest.raises(ValueError, match="multiple of 128"):
        Fp8Weight.cat([parts[0], odd])
    with pytest.raises(ValueError, match="differ"):
        Fp8Weight.cat([parts[0], Fp8Weight.quantize(torch.randn(128, 128), torch.bfloat16)])
    with pytest.raises(ValueError, match="at least one"):
        Fp8Weight.cat([])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block"])
@pytest.mark.parametrize("m", [5, 40, 130])  # 16-bit x, then fp8 x on both tile sizes
def test_fp8_matmul_against_float32_math(m: int, block, dtype: torch.dtype) -> None:
    """Through the Triton GEMM here (the interpreter); on a Hopper, cuBLAS past 16 rows."""
    if not ON_CUDA and dtype == torch.bfloat16 and m <= fp8_kernels.SMALL_ROWS:
        pytest.skip("the interpreter's tl.dot takes no bfloat16")
    torch.manual_seed(m)
    n, k = 272, 320  # ragged for the 128 blocks and the tiles
    fw = Fp8Weight.quantize(torch.randn(n, k, device=DEVICE), dtype, block)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    y = fp8_kernels.fp8_matmul(x, fw.weight, fw.scale, bias, block)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_err(y, matmul_ref(x, fw, bias)) < OUT_TOLERANCE[dtype]
    exact = x.float() @ fw.dequantize().t() + bias.float()  # quantizing x costs ~2^-5
    assert rel_err(y, exact) < 0.05


@pytest.mark.skipif(ON_CUDA, reason="the CPU's refusal")
def test_matmul_refuses_the_cpu_in_one_line() -> None:
    fw = Fp8Weight.quantize(torch.randn(32, 32), torch.bfloat16)
    reason = fp8_supported("cpu")
    assert reason is not None and "CUDA" in reason and "\n" not in reason
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        fw.matmul(torch.randn(2, 32).to(torch.bfloat16))


def test_rejects_wrong_blocks_and_scales() -> None:
    codes = torch.zeros(8, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float32"):
        Fp8Weight(codes, torch.ones(8, dtype=torch.bfloat16), None, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Fp8Weight(codes, torch.ones(8), None, torch.float32)
    with pytest.raises(ValueError, match="128x128"):
        fp8_kernels.fp8_matmul(torch.ones(1, 8), codes, torch.ones(1, 1), None, (64, 64))
    with pytest.raises(ValueError, match="128, 128"):
        Fp8Weight.quantize(torch.randn(8, 8), torch.bfloat16, (1, 128))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("group", [None, 128], ids=["token", "group"])
def test_rms_norm_fp8_makes_the_quantizers_codes(
    dtype: torch.dtype, with_residual: bool, group: int | None
) -> None:
    """The norm's codes in its own launch: bit for bit what the 16-bit norm then the
    quantizer give (per group: zero rows up to a multiple of 4), and the residual stream
    added the same."""
    torch.manual_seed(3)
    m, k = 19, 300
    x = (torch.randn(m, k) * 4).to(dtype).to(DEVICE)
    weight = torch.randn(k).to(dtype).to(DEVICE)
    residual = torch.randn(m, k).to(dtype).to(DEVICE) if with_residual else None
    theirs_res = residual.clone() if residual is not None else None
    ours = rms_norm_fp8(x, weight, 1e-6, residual, group=group)
    check_made_codes(ours, rms_norm(x, weight, 1e-6, theirs_res), group)
    if residual is not None and theirs_res is not None:
        assert torch.equal(residual, theirs_res)


def check_made_codes(ours: Fp8Rows, y: Tensor, group: int | None) -> None:
    """`ours` as the quantizers make them of y: per token, or per group padded to 4 rows
    (the zero rows included)."""
    if group is None:
        ref_q, ref_s = fp8_quant.quantize_per_token(y)
    else:
        ref_q, ref_s = fp8_quant.quantize_per_token_group(y, 4)
        assert ours.scale.stride(0) == 1  # column-major, as cuBLAS takes them
    assert ours.num_rows == y.shape[0] and ours.group == group
    assert ours.scale.shape == ref_s.shape and torch.equal(ours.scale, ref_s)
    check_codes(ours.codes, ref_q)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("one_pass", "group"),
    [(True, None), (False, None), (False, 128)],
    ids=["registers", "chunks", "group"],
)
def test_silu_and_mul_fp8_makes_the_quantizers_codes(
    activation: str,
    dtype: torch.dtype,
    one_pass: bool,
    group: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row in registers, or (a narrower bound) in two chunks with a ragged end, or per
    group in chunks; a zero row."""
    if not one_pass:
        monkeypatch.setattr(activation_kernels, "FP8_ONE_PASS", 1024)
    torch.manual_seed(4)
    x = (torch.randn(5, 4200) * 2).to(dtype).to(DEVICE)  # width 2,100
    x[2] = 0.0
    ours = activation_kernels.silu_and_mul_fp8(x, activation, group=group)
    check_made_codes(ours, activation_kernels.silu_and_mul(x, activation), group)
    assert float(ours.scale[2].min()) > 0


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block"])
def test_a_product_takes_the_codes_as_it_would_make_them(block: tuple[int, int] | None) -> None:
    """Fp8Weight's product of codes made before (fp8_matmul_rows, or per group
    fp8_matmul_groups on rows padded to 4) equals fp8_matmul quantizing x itself; past
    SMALL_ROWS rows a weight takes codes."""
    torch.manual_seed(5)
    fw = Fp8Weight.quantize(torch.randn(256, 384, device=DEVICE), torch.float16, block)
    x = torch.randn(41, 384, device=DEVICE).to(torch.float16)
    if block is None:
        xq, xs = fp8_quant.quantize_per_token(x)
        ours = fp8_kernels.fp8_matmul_rows(xq, xs, fw.weight, fw.scale, None, out_dtype=x.dtype)
    else:
        xq, xs = fp8_quant.quantize_per_token_group(x, 4)
        ours = fp8_kernels.fp8_matmul_groups(
            xq, xs, 41, fw.weight, fw.scale, None, out_dtype=x.dtype
        )
    assert torch.equal(ours, fp8_kernels.fp8_matmul(x, fw.weight, fw.scale, None, block))
    assert fw.code_group == (None if block is None else 128)
    small = fp8_kernels.SMALL_ROWS
    assert fw.takes_codes(small + 1) and not fw.takes_codes(small)
