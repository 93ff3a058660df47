#!/usr/bin/env bash
# Time-sliced against MPS (--gpu-sharing mps) on one GPU, in rotation on one machine, so
# that its drift falls on both alike (docs/benchmarks.md, "Prefill and decode on one GPU
# through MPS"): the Llama-3-8B shape, disaggregated, default flags otherwise.
#   RUNS="C:N[:P] ..." scripts/gpu-mps.sh [ROUNDS] [MPS FLAGS...]
# ROUNDS (default 2) of each setting, the order swapped every round; MPS FLAGS go to the
# mps runs (e.g. --mps-prefill-percent 60). Carry .whl and .gpu-assets. Each run's
# summary is $OUT/stages-LABEL.txt (gpu-stages.sh); a table of all of them at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
shift 2>/dev/null || true
out=${OUT:-gpu-out}
for ((r = 0; r < rounds; r++)); do
  order=("ts" "mps")
  ((r % 2)) && order=("mps" "ts")
  for side in "${order[@]}"; do
    if [[ $side == mps ]]; then
      scripts/gpu-stages.sh llama3-8b-shape disaggregated "mps-$r" --gpu-sharing mps "$@" >/dev/null 2>&1
    else
      scripts/gpu-stages.sh llama3-8b-shape disaggregated "ts-$r" >/dev/null 2>&1
    fi
  done
done
printf "%-8s %5s %12s %14s %14s\n" run c "out tok/s" "TTFT p50 ms" "ITL p99 ms"
for file in "$out"/stages-ts-* "$out"/stages-mps-*; do
  label=$(basename "$file" .txt)
  awk -v label="${label#stages-}" '
    /in flight/ { for (i = 1; i <= NF; i++) if ($i == "most") c = $(i + 1) }
    /^output throughput/ { tput = $3 }
    /^TTFT/ { ttft = $3 }
    /^ITL/ { printf "%-8s %5s %12s %14s %14s\n", label, c, tput, ttft, $5 }' "$file"
done
