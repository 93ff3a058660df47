"""The sum over k of a layer of experts (kernels/moe_sum.py): each token's k rows summed
as torch sums them (float32, rounded once), for k a power of two or not, a width that is
not a multiple of a program's columns, no tokens; torch's sum where the rows are not
contiguous, or with the kernel switched off; rows that are not T k refused. Through
Triton's interpreter without CUDA, compiled with it.
"""

from __future__ import annotations

import pytest
import torch

# First: without CUDA this switches Triton to its interpreter before turbo is imported.
from tests.unit.test_turbo_kernels import DEVICE, DTYPES, TOLERANCE, rel_err

pytest.importorskip("triton")

from lmd.engine.turbo.kernels import moe_sum


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES])
@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(3, 8, 2048), (5, 6, 1500), (1, 2, 64)])
def test_each_tokens_rows_summed_as_torch_sums_them(
    dtype: torch.dtype, tokens: int, top_k: int, hidden: int
) -> None:
    torch.manual_seed(0)
    rows = torch.randn(tokens * top_k, hidden, device=DEVICE).to(dtype)
    out = moe_sum.sum_over_k(rows, tokens, top_k)
    ref = rows.float().view(tokens, top_k, hidden).sum(dim=1)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    # One rounding to dtype, of float32 sums that may differ in their last bits.
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else TOLERANCE[dtype])
    assert torch.allclose(out.float(), rows.view(tokens, top_k, hidden).sum(dim=1).float(),
                          rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-5)  # fmt: skip


def test_no_tokens_and_the_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = torch.empty(0, 32, device=DEVICE)
    assert moe_sum.sum_over_k(empty, 0, 4).shape == (0, 32)
    rows = torch.randn(8, 2 * 32, device=DEVICE)[:, :32]  # not contiguous: torch's sum
    assert torch.equal(moe_sum.sum_over_k(rows, 2, 4), rows.reshape(2, 4, 32).sum(dim=1))
    with pytest.raises(ValueError, match="rows are not"):  # not 2 tokens' 4 rows each
        moe_sum.sum_over_k(torch.randn(7, 32, device=DEVICE), 2, 4)
    monkeypatch.setattr(moe_sum, "TRITON_SUM", False)
    rows = torch.randn(8, 32, device=DEVICE)
    assert torch.equal(moe_sum.sum_over_k(rows, 2, 4), rows.view(2, 4, 32).sum(dim=1))
