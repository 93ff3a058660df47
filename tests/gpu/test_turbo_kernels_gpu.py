"""The turbo kernels compiled on a GPU, in bfloat16 and float16, at serving shapes
(Llama-3-8B's 32/8x128 heads, SmolLM2's 9/3x64, Qwen2's groups of 7, long contexts,
many splits), against float32 references. The smaller shapes of
tests/unit/test_turbo_kernels.py run there too, compiled, on a GPU. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.turbo import kernels
from tests.unit.test_turbo_gemv import check_gemv, check_vector_gemv
from tests.unit.test_turbo_kernels import (
    TOLERANCE,
    Attention,
    DecodeCase,
    check_decode,
    rel_err,
    rms_norm_ref,
)
from tests.unit.test_turbo_prefill import PrefillCase, check_prefill

pytestmark = pytest.mark.gpu
HALF = [torch.bfloat16, torch.float16]
LLAMA3 = Attention(32, 8, 128, 64)
SMOLLM2 = Attention(9, 3, 64, 64)
QWEN2 = Attention(28, 4, 128, 64)

DECODE = [
    DecodeCase(LLAMA3, [1, 63, 64, 65, 1000, 4097], splits=1),
    DecodeCase(LLAMA3, [8192], splits=16),
    DecodeCase(LLAMA3, [700, 2, 3000, 513], splits=4),
    DecodeCase(SMOLLM2, [512 + i * 37 for i in range(64)], splits=1),
    DecodeCase(SMOLLM2, [2048, 0, 1], splits=8),
    DecodeCase(QWEN2, [129, 4000], splits=2),
    DecodeCase(Attention(32, 8, 128, 16), [300, 5000], window=1024, splits=8),
]
PREFILL = [
    PrefillCase(LLAMA3, [512, 512, 1], [0, 0, 700]),
    PrefillCase(LLAMA3, [1024], [1000]),  # a chunk after a cached prefix
    PrefillCase(SMOLLM2, [257, 3, 64], [0, 61, 128]),
    PrefillCase(QWEN2, [300], [0]),
    PrefillCase(Attention(32, 8, 128, 16), [700], [500], window=256),
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", DECODE)
def test_decode_attention_at_serving_shapes(case: DecodeCase, dtype: torch.dtype) -> None:
    check_decode(case, dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", PREFILL)
def test_prefill_attention_at_serving_shapes(case: PrefillCase, dtype: torch.dtype) -> None:
    check_prefill(case, dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("rows", "cols"), [(1, 4096), (512, 4096), (8192, 576)])
def test_fused_add_rms_norm_at_serving_shapes(rows: int, cols: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, cols, device="cuda").to(dtype)
    residual = torch.randn(rows, cols, device="cuda").to(dtype)
    w = torch.randn(cols, device="cuda").to(dtype)
    summed = residual.float() + x.float()
    out = kernels.rms_norm(x, w, 1e-5, residual=residual)
    assert rel_err(residual, summed) < TOLERANCE[dtype]
    assert rel_err(out, rms_norm_ref(summed, w, 1e-5)) < 2 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("rows", "width"), [(1, 14336), (512, 1536), (4096, 14336)])
def test_silu_and_mul_at_serving_shapes(rows: int, width: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, 2 * width, device="cuda").to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert rel_err(kernels.silu_and_mul(x), ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 6144, 4096), (4, 28672, 4096), (1, 4096, 14336), (16, 960, 576), (1, 49152, 576)],
)
def test_gemv_at_decode_shapes(rows: int, n: int, k: int, dtype: torch.dtype) -> None:
    """Llama-3-8B's and SmolLM2's projections and lm_head at decode batches."""
    check_gemv(rows, n, k, dtype, bias=n == 960, out_float=n == 49152)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    ("n", "k", "prologue", "out_float"),
    [
        (6144, 4096, "norm", False),  # Llama-3-8B qkv after the input norm (layer 0)
        (3072, 4096, "norm residual", False),  # qkv of one rank of two
        (28672, 4096, "norm residual", False),  # gate|up
        (128256, 4096, "norm residual", True),  # lm_head, float32 logits
        (960, 576, "bias", False),  # SmolLM2 / Qwen2 qkv with a bias
    ],
)
def test_vector_gemv_at_batch_one_shapes(
    n: int, k: int, prologue: str, out_float: bool, dtype: torch.dtype
) -> None:
    check_vector_gemv(n, k, dtype, prologue, out_float)
