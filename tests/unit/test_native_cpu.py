"""What the CPU runs natively (engine/torch_backend/native_cpu.py): bf16 dot products."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmd.engine.torch_backend.native_cpu import has_bf16_dot

ZEN4 = "fpu vme avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = "fpu avx2 avx512f amx_bf16 amx_tile amx_int8"
AVX2_ONLY = "fpu vme avx2 fma f16c"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(ZEN4, True), (SAPPHIRE_RAPIDS, True), (AVX2_ONLY, False), ("avx512_bf16x", False)],
)
def test_bf16_dot_products_are_read_from_the_cpu_flags(
    tmp_path: Path, flags: str, expected: bool
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\n")
    assert has_bf16_dot(cpuinfo) is expected


def test_no_cpuinfo_means_no_bf16(tmp_path: Path) -> None:
    assert has_bf16_dot(tmp_path / "missing") is False
    (tmp_path / "noflags").write_text("processor\t: 0\n")
    assert has_bf16_dot(tmp_path / "noflags") is False
