#!/usr/bin/env bash
# Regenerates the PTX of the kernels under native/kernels/ (needs nvcc):
#   copy_chunks.cu -> copy_chunks.ptx: compute_75 (Turing and newer)
#   w4a16_rows.cu, w4a16_wide.cu, w4a16_experts.cu -> .ptx: compute_80 (their bf16 mma,
#     cp.async)
#   fp8_rows.cu -> fp8_rows.ptx: compute_89 (e4m3 conversions: Ada, Hopper and newer)
#   w4a16_wgmma.cu -> w4a16_wgmma.ptx: compute_90a (wgmma, mbarriers: Hopper only)
# Each is stamped the oldest PTX ISA it needs (7.0 where it can: drivers from CUDA 11.0 on
# JIT it; 8.1, CUDA 12.1, for fp8_rows' cvt.e4m3x2 on sm_89), and ptxas checks that below.
# setup.py embeds each .ptx in lmd._native as a char array (kCopyChunksPtx,
# kW4a16RowsPtx, kW4a16WidePtx, kW4a16ExpertsPtx, kFp8RowsPtx, kW4a16WgmmaPtx), so lmd
# builds without nvcc.
# w4a16_ops.cuh holds what the tensor-core kernels share.
set -euo pipefail
cd "$(dirname "$0")"

# ptx NAME ARCH [PTX_ISA]
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
ptx w4a16_experts 80
ptx fp8_rows 89 8.1
ptx w4a16_wgmma 90a 8.0
