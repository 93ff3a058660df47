"""The batch-1 products launched with programmatic dependent launch (kernels/pdl.py):
a chain of them, each reading what the one before wrote, replayed in a CUDA graph,
equals the same chain launched plainly, bit for bit. A product that read its input
before the kernel before it had finished would read the previous replay's values.
Hopper or later; skipped elsewhere and without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("programmatic dependent launch needs sm_90 or later", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.turbo import kernels
from lmd.engine.turbo.kernels import pdl

pytestmark = pytest.mark.gpu
LAYERS, HIDDEN, WIDE = 6, 4096, 6144


Weights = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def chain(
    x: torch.Tensor, residual: torch.Tensor, weights: Weights
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's shape: norm + product (vector_gemv), then the row back (gemv)."""
    for norm_w, w_in, w_out in weights:
        summed = torch.empty_like(residual)
        h = kernels.vector_gemv(x, w_in, norm=kernels.Norm(norm_w, 1e-5, residual, summed))
        x, residual = kernels.gemv(h, w_out), summed
    return x, residual


def test_a_chain_of_pdl_products_in_a_graph_equals_plain_launches() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen, device="cuda")).bfloat16()

    weights = [
        (1 + rand(HIDDEN, scale=0.1), rand(WIDE, HIDDEN, scale=HIDDEN**-0.5),
         rand(HIDDEN, WIDE, scale=WIDE**-0.5))
        for _ in range(LAYERS)
    ]  # fmt: skip
    x, residual = rand(1, HIDDEN), rand(1, HIDDEN)
    want = chain(x, residual, weights)
    try:
        pdl.ENABLED = True
        assert pdl.launch_options(x.device) == {"launch_pdl": True}
        eager = chain(x, residual, weights)
        static_x, static_res = x.clone(), residual.clone()
        chain(static_x, static_res, weights)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x, static_res, weights)
        for step in range(4):  # each replay starts from other inputs
            new_x, new_res = rand(1, HIDDEN), rand(1, HIDDEN)
            static_x.copy_(new_x)
            static_res.copy_(new_res)
            graph.replay()
            pdl.ENABLED = False
            plain = chain(new_x, new_res, weights)
            pdl.ENABLED = True
            assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1]), step
    finally:
        pdl.ENABLED = False
    assert torch.equal(eager[0], want[0]) and torch.equal(eager[1], want[1])
