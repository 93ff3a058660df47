"""The native FP8 decode kernel's host side (engine/turbo/kernels/fp8_rows.py,
lmd._native.fp8_rows) on a machine without a GPU: what it declines and its argument
checks before any CUDA call. Its PTX is test_native_ptx.py's, its products
tests/gpu/test_fp8_rows_gpu.py's."""

from __future__ import annotations

import re

import pytest
import torch

from lmd import _native
from lmd.engine.turbo.kernels import fp8_rows
from tests.unit.test_w4a16_rows import BAD_LAUNCHES

SHAPES = "m must be 1..16, n a multiple of 32, k of 128, x_stride >= k and s_stride 0 or >= k / 128"


def launch(rows: int, n: int, k: int, warps: int, *, x: int = 64, stride: int = 0,
           s_stride: int = 0) -> None:  # fmt: skip
    _native.fp8_rows(0, x, 64, 64, 0, 64, rows, n, k, stride or k, s_stride, True, warps, 0)


def test_cpu_tensors_stay_with_the_triton_kernel() -> None:
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    w = torch.randn(64, 256).to(torch.float8_e4m3fn)
    assert fp8_rows.native_rows(x, w, torch.ones(64), None, block_scaled=False) is None


@pytest.mark.parametrize(("args", "message"), BAD_LAUNCHES)
def test_bad_launches_are_refused_before_cuda(
    args: tuple[int, int, int, int], message: str | None
) -> None:
    with pytest.raises(ValueError, match=re.escape(message or SHAPES)):
        launch(*args)


def test_block_scales_need_a_row_of_k_blocks() -> None:
    with pytest.raises(ValueError, match=re.escape(SHAPES)):
        launch(1, 64, 512, 4, s_stride=3)  # k / 128 = 4 blocks a row
    with pytest.raises(RuntimeError, match="CUDA"):  # the shapes pass; no GPU here
        launch(1, 64, 512, 4, s_stride=4)


def test_misaligned_addresses_are_refused() -> None:
    with pytest.raises(ValueError, match="misaligned"):
        launch(1, 64, 256, 4, x=72)  # x 8-byte aligned only
    with pytest.raises(ValueError, match="misaligned"):
        launch(1, 64, 256, 4, stride=260)  # a row stride not a multiple of 8


@pytest.mark.skipif(_native.probe_cuda()["available"], reason="this machine has CUDA")
def test_without_cuda_it_says_why() -> None:
    assert "CUDA" in _native.fp8_rows_ready(0)
    with pytest.raises(RuntimeError, match="CUDA"):
        launch(1, 64, 256, 4)
