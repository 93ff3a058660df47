"""kernels/l2_prefetch.py off a GPU: a hint that does nothing on CPU tensors (the
interpreter cannot run inline PTX), its chunk checked first; and the tensors of each
kind of weight that TurboModel asks for (tests/gpu/test_l2_prefetch_gpu.py runs it)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lmd.engine.turbo.kernels.l2_prefetch import prefetch_l2, supported
from lmd.engine.turbo.model import tensors_of
from lmd.engine.turbo.quant.fp8 import Fp8Weight
from lmd.engine.turbo.quant.w4a16 import W4A16Weight


def test_a_cpu_tensor_is_skipped() -> None:
    t = torch.zeros(64, dtype=torch.bfloat16)
    assert not supported(t)
    prefetch_l2(t)
    assert not t.any()


@pytest.mark.parametrize("chunk", [0, -16, 24])
def test_a_chunk_not_a_positive_multiple_of_16_is_refused(chunk: int) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        prefetch_l2(torch.zeros(8), chunk=chunk)


def test_the_tensors_of_each_kind_of_weight() -> None:
    dense = torch.randn(256, 128)
    assert tensors_of(dense) == (dense,)
    w4 = W4A16Weight.quantize(dense, 128)
    assert tensors_of(w4) == (w4.qweight, w4.scales, w4.zeros)
    codes = dense.to(torch.float8_e4m3fn)
    fp8 = Fp8Weight(codes, torch.ones(256), None, torch.bfloat16)
    assert tensors_of(fp8) == (fp8.weight, fp8.scale)
