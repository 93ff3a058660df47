"""The 4-bit rows kernel's launches that do more than the product, on a GPU: the normed
entries (native/kernels/w4a16_rows.cu, through kernels/w4a16_normed.py's native_normed and
W4A16Weight.matmul_normed: one row of RMSNorm(x + residual) made in the product's
launch) against rms_norm and then the product; its gated launches at 1-16 rows against
silu_and_mul of the product; and a 4-bit model's one-row decode steps with the norms in
the products' launches against the same steps with the norms' own kernels. Skipped
without CUDA.

Bounds: the residual stream after the add is rms_norm's to the bit (the same sum, rounded
once). The normed x can differ from rms_norm's only where the float32 sum of squares,
added in another order, moves 1 / rms across a rounding of x * 1 / rms * gamma: rarely
and by one unit of the dtype, so the products are held to test_w4a16_rows_gpu.py's bound
against the product of rms_norm's x. SiLU's gate is the kernel's own sigmoid on the two
products rounded to the dtype, within two units of silu_and_mul's (as the wgmma kernel's
gated launch is held).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.turbo import kernels
from lmd.engine.turbo.backend import TurboBackend
from lmd.engine.turbo.kernels import Norm, rms_norm, silu_and_mul
from lmd.engine.turbo.kernels.w4a16_normed import native_normed
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from tests.gpu.test_turbo_families_gpu import FAMILIES
from tests.gpu.test_w4a16_rows_gpu import ATOL, RTOL, native, reference, weight
from tests.models import random_prompts
from tests.unit.test_turbo_model import greedy, new_pool

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16]


def row_inputs(k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """x, residual [1, k] and a norm's weight [k] of a decoder's magnitudes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, k, device="cuda", generator=g).to(dtype)
    residual = (4 * torch.randn(1, k, device="cuda", generator=g)).to(dtype)
    gamma = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(dtype)
    return x, residual, gamma


def packed(w: W4A16Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    return (w.qweight, w.scales, w.zeros, w.group_size)


def normed(
    x: torch.Tensor,
    gamma: torch.Tensor,
    residual: torch.Tensor | None,
    w: W4A16Weight,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """native_normed's product (asserted taken) and the summed stream (None without a
    residual)."""
    summed = None if residual is None else torch.empty_like(residual)
    y = torch.empty(1, w.shape[0] // (2 if gated else 1), dtype=x.dtype, device="cuda")
    assert native_normed(x, gamma, EPS, residual, summed, packed(w), bias, y, gated=gated)
    return y, summed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (96, 256)])
@pytest.mark.parametrize("add", [True, False])
def test_normed_is_rms_norm_then_the_product(n: int, k: int, dtype: torch.dtype, add: bool) -> None:
    """(4096, 14336): down's K, 28 KB of x in shared memory; (96, 256): three CTAs, two
    blocks of K."""
    w = weight(n, k, dtype)
    x, residual, gamma = row_inputs(k, dtype, n + k)
    before = residual.clone()
    bias = torch.randn(n, device="cuda").to(dtype)
    for b in (None, bias):
        y, summed = normed(x, gamma, residual if add else None, w, b)
        stream = before.clone()
        h = rms_norm(x, gamma, EPS, stream if add else None)
        assert torch.equal(residual, before)  # read, not written
        if add:
            assert summed is not None and torch.equal(summed, stream)
        rtol = 4 * RTOL[dtype]  # two roundings of the output apart, at most
        torch.testing.assert_close(y, native(h, w, b), rtol=rtol, atol=ATOL)
        torch.testing.assert_close(y.double(), reference(h, w, b), rtol=rtol, atol=ATOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(28672, 4096), (2816, 512), (128, 256)])
def test_normed_gated_is_silu_and_mul_of_the_product(n: int, k: int, dtype: torch.dtype) -> None:
    """W = gate | up, one row: the norm and SiLU's gate in one launch."""
    w = weight(n, k, dtype)
    x, residual, gamma = row_inputs(k, dtype, n)
    y, summed = normed(x, gamma, residual, w, gated=True)
    stream = residual.clone()
    ref = silu_and_mul(native(rms_norm(x, gamma, EPS, stream), w))
    assert summed is not None and torch.equal(summed, stream)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, ref, rtol=2 * eps, atol=2 * eps * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 16])
@pytest.mark.parametrize(("n", "k"), [(28672, 4096), (192, 256)])
def test_rows_gated_is_silu_and_mul_of_the_product(
    n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    """1-16 rows (one and two x tiles): SiLU's gate in the rows kernel's launch.
    (192, 256): six CTAs of 16 outputs, two blocks of K."""
    w = weight(n, k, dtype)
    x = torch.randn(rows, k, device="cuda").to(dtype)
    y = native(x, w, gated=True)
    ref = silu_and_mul(native(x, w))
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, ref, rtol=2 * eps, atol=2 * eps * float(ref.abs().max()))
    assert torch.equal(native(x, w, gated=True), y)
    assert torch.equal(w.matmul(x, None, "silu"), y)  # W4A16Weight takes the launch


def test_normed_is_deterministic_and_captured_in_a_graph() -> None:
    w = weight(6144, 4096, torch.bfloat16)
    x, residual, gamma = row_inputs(4096, torch.bfloat16, 7)
    summed = torch.empty_like(residual)
    y = torch.empty(1, 6144, dtype=torch.bfloat16, device="cuda")
    assert native_normed(x, gamma, EPS, residual, summed, packed(w), None, y)  # loads, warms
    first = (y.clone(), summed.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        native_normed(x, gamma, EPS, residual, summed, packed(w), None, y)
    y.zero_()
    graph.replay()
    assert torch.equal(y, first[0]) and torch.equal(summed, first[1])
    x.copy_(row_inputs(4096, torch.bfloat16, 8)[0])  # new inputs, the same graph
    graph.replay()
    eager, eager_summed = normed(x, gamma, residual, w)
    assert eager_summed is not None
    assert torch.equal(y, eager) and torch.equal(summed, eager_summed)


def test_refused_where_the_kernel_does_not_take_it() -> None:
    """More rows, a K past shared memory's room, a float32 norm weight, misaligned x, the
    stream written over its own residual: False, nothing written; matmul_normed then says
    None and the model runs the norm's kernel."""
    w = weight(128, 256, torch.bfloat16)
    x, residual, gamma = row_inputs(256, torch.bfloat16, 9)
    y = torch.zeros(2, 128, dtype=torch.bfloat16, device="cuda")
    odd = torch.empty(1, 260, dtype=torch.bfloat16, device="cuda")[:, 4:]  # 8 bytes in
    cases = [
        (torch.cat([x, x]), gamma, residual, None),
        (x, gamma.float(), residual, None),
        (odd.copy_(x), gamma, residual, None),
        (x, gamma, residual, residual),
    ]
    for xs, g, r, summed in cases:
        assert not native_normed(xs, g, EPS, r, summed, packed(w), None, y[: xs.shape[0]])
    assert not y.any()
    assert w.matmul_normed(x, Norm(gamma, EPS, residual), None, "gelu_pytorch_tanh") is None
    wide = weight(128, 16384 + 128, torch.bfloat16)
    big = row_inputs(16384 + 128, torch.bfloat16, 10)
    assert wide.matmul_normed(big[0], Norm(big[2], EPS, big[1])) is None
    x, residual, gamma = row_inputs(4096, torch.bfloat16, 11)
    w = weight(128, 4096, torch.bfloat16)
    y = torch.zeros(1, 128, dtype=torch.bfloat16, device="cuda")
    assert not native_normed(x, gamma, EPS, residual, None, packed(w), None, y, warps=2)  # 2,048


def test_4_bit_one_row_steps_take_the_norms_in_the_products(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3 under --quantization w4a16, one sequence at a time in CUDA graphs: the
    one-row steps' logits, fed the same tokens, are those of steps with the norms' own
    kernels (w4a16_norms off) within bf16's rounding of a few inputs: top-1 the same,
    logits within 2% of their largest. Eager, a one-row step runs no RMSNorm kernel of
    its own (both a layer's norms in its 4-bit products, SiLU's gate in gate|up's)."""
    model_class, config = FAMILIES["qwen3"]
    path = tmp_path_factory.mktemp("qwen3-w4")
    torch.manual_seed(11)
    model_class(config).to(torch.bfloat16).save_pretrained(path)  # type: ignore[arg-type]

    def backend(*, norms: bool, graphs: bool = True) -> TurboBackend:
        made = TurboBackend(path, CUDA, torch.bfloat16, quantization="w4a16", cuda_graphs=graphs)
        made.model.w4a16_norms = norms
        return made

    fused, separate = backend(norms=True), backend(norms=False)
    for prompt in random_prompts([17, 130, 5], fused.vocab_size, seed=12):
        logits: list[list[torch.Tensor]] = [[], []]
        tokens: list[int] = []
        for i, b in enumerate((fused, separate)):
            kv = new_pool(b, 512, 16)
            b.capture_graphs(kv, max_batch_size=1)
            force = [tokens] if tokens else None
            out = greedy(b, [prompt], 24, kv=kv, force=force, logits=logits[i])
            tokens = tokens or out[0]
        for a, b_ in zip(*logits, strict=True):
            assert torch.equal(a.argmax(-1), b_.argmax(-1))
            assert float((a - b_).abs().max()) <= 0.02 * float(b_.abs().max())

    norms = 0

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal norms
        norms += 1
        return rms_norm(*args, **kwargs)

    monkeypatch.setattr(kernels, "rms_norm", counted)
    eager = backend(norms=True, graphs=False)
    layers = len(eager.model.weights.layers)
    greedy(eager, [[3]], 3, kv=new_pool(eager, 64, 16))  # a one-token prompt: all one-row
    assert norms == 0, "a one-row 4-bit step ran an RMSNorm kernel of its own"
    eager.model.w4a16_norms = False
    greedy(eager, [[3]], 3, kv=new_pool(eager, 64, 16))
    assert norms == 3 * layers * 2  # three steps, two norms a layer
