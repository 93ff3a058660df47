#!/usr/bin/env bash
# Regenerates the PTX of the kernels under native/kernels/ (needs nvcc):
#   copy_chunks.cu -> copy_chunks.ptx: compute_75 (Turing and newer)
#   w4a16_rows.cu, w4a16_wide.cu -> .ptx: compute_80 (their bf16 mma, cp.async)
# Each is stamped PTX ISA 7.0, so that drivers from CUDA 11.0 on can JIT it (no kernel
# uses anything newer; ptxas checks that below). setup.py embeds each .ptx in lmd._native
# as a char array (kCopyChunksPtx, kW4a16RowsPtx, kW4a16WidePtx), so lmd builds without
# nvcc. w4a16_ops.cuh is the W4A16 kernels' shared part.
set -euo pipefail
cd "$(dirname "$0")"

# ptx NAME ARCH
ptx() {
  local name=$1 arch=$2
  nvcc -ptx -arch="compute_$arch" -O3 "$name.cu" -o "$name.ptx"
  sed -i -e 's/^\.version .*/.version 7.0/' -e '/^\/\/ Compiler Build ID/d' "$name.ptx"
  ptxas -arch="sm_$arch" "$name.ptx" -o /dev/null
  echo "wrote native/kernels/$name.ptx"
}

ptx copy_chunks 75
ptx w4a16_rows 80
ptx w4a16_wide 80
