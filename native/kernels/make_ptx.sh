#!/usr/bin/env bash
# Regenerates the PTX of the kernels under native/kernels/ (needs nvcc):
#   copy_chunks.cu -> copy_chunks.ptx: compute_75 (Turing and newer)
#   w4a16_rows.cu, w4a16_wide.cu -> .ptx: compute_80 (their bf16 mma, cp.async)
#   w4a16_wgmma.cu -> w4a16_wgmma.ptx: compute_90a (wgmma), PTX ISA 8.0
# The others are stamped PTX ISA 7.0, so that drivers from CUDA 11.0 on can JIT them
# (none uses anything newer; ptxas checks that below). setup.py embeds each .ptx in
# lmd._native as a char array (kCopyChunksPtx, kW4a16RowsPtx, ...), so lmd builds
# without nvcc. w4a16_ops.cuh and w4a16_wide.cuh are the W4A16 kernels' shared parts.
set -euo pipefail
cd "$(dirname "$0")"

# ptx NAME ARCH [ISA]
ptx() {
  local name=$1 arch=$2 isa=${3:-7.0}
  nvcc -ptx -arch="compute_$arch" -O3 "$name.cu" -o "$name.ptx"
  sed -i -e "s/^\.version .*/.version $isa/" -e '/^\/\/ Compiler Build ID/d' "$name.ptx"
  ptxas -arch="sm_$arch" "$name.ptx" -o /dev/null
  echo "wrote native/kernels/$name.ptx"
}

ptx copy_chunks 75
ptx w4a16_rows 80
ptx w4a16_wide 80
ptx w4a16_wgmma 90a 8.0
