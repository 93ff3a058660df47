"""The tensor-core kernels' embedded PTX (native/kernels/*.ptx, which setup.py builds into
lmd._native and the driver JIT-compiles): ptxas must assemble each for the oldest GPU it
is for and for sm_90 without spilling, and each must be what its .cu compiles to
(native/kernels/make_ptx.sh run after the last edit). Needs the CUDA toolkit's ptxas and
nvcc, not a GPU."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "native"
# name: (make_ptx.sh's compute arch, its PTX ISA stamp, entry functions)
KERNELS = {
    "w4a16_rows": ("80", "7.0", 6),  # + the normed entries
    "w4a16_wide": ("80", "7.0", 2),
    "w4a16_experts": ("80", "7.0", 4),
    "fp8_rows": ("89", "8.1", 4),
    "w4a16_wgmma": ("90a", "8.0", 4),  # sm_90a only: its oldest GPU is its newest; + experts
}


def targets(arch: str) -> list[str]:
    """ptxas's targets for PTX made for compute_`arch`: its own GPU and sm_90 (one GPU for
    sm_90a's)."""
    return [arch] if arch.startswith("90") else [arch, "90"]


ASSEMBLED = [(name, target) for name, (arch, _, _) in KERNELS.items() for target in targets(arch)]


def embedded_ptx(name: str) -> str:
    """What setup.py embeds in lmd._native (make_ptx.sh's output)."""
    return (NATIVE / "kernels" / f"{name}.ptx").read_text()


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas (CUDA toolkit)")
@pytest.mark.parametrize(("name", "target"), ASSEMBLED)
def test_embedded_ptx_assembles_without_spills(tmp_path: Path, name: str, target: str) -> None:
    entries = KERNELS[name][2]
    ptx = tmp_path / f"{name}.ptx"
    ptx.write_text(embedded_ptx(name))
    done = subprocess.run(
        ["ptxas", f"-arch=sm_{target}", "-v", str(ptx), "-o", str(tmp_path / "out.cubin")],
        capture_output=True,
        text=True,
        check=True,
    )  # fmt: skip
    report = done.stderr
    assert report.count("Compiling entry function") == entries
    assert "bytes spill stores" in report and " 0 bytes spill stores" in report
    assert not re.search(r"[1-9]\d* bytes spill", report), report


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc (CUDA toolkit)")
@pytest.mark.parametrize("name", list(KERNELS))
def test_embedded_ptx_is_what_the_source_compiles_to(tmp_path: Path, name: str) -> None:
    """native/kernels/make_ptx.sh was run after the last edit of the .cu or of the
    headers it includes (for the nvcc release that made the embedded PTX; another release may
    word it differently)."""
    arch, isa, _ = KERNELS[name]
    ptx = embedded_ptx(name)
    made_by = re.search(r"Cuda compilation tools, release ([\d.]+)", ptx)
    version = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True)
    if made_by is None or f"release {made_by.group(1)}," not in version.stdout:
        pytest.skip("another nvcc release than the one that made the embedded PTX")
    out = tmp_path / f"{name}.ptx"
    subprocess.run(
        ["nvcc", "-ptx", f"-arch=compute_{arch}", "-O3", str(NATIVE / "kernels" / f"{name}.cu"),
         "-o", str(out)],
        check=True,
    )  # fmt: skip
    fresh = re.sub(r"(?m)^\.version .*$", f".version {isa}", out.read_text())
    fresh = re.sub(r"(?m)^// Compiler Build ID.*\n", "", fresh)
    assert fresh == ptx
