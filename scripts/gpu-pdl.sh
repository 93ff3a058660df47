#!/usr/bin/env bash
# Programmatic dependent launch (turbo/kernels/pdl.py) on a GPU machine (the device tool):
#   scripts/gpu-pdl.sh [SHAPES]
#       nvidia-h200, ~8 minutes: tests/gpu/test_turbo_pdl_gpu.py (PDL launches against
#       plain ones, bit for bit), then for each random_models.py shape (default
#       llama3-8b-shape,qwen3-8b-shape) scripts/families_bench.py --batches 1 --pdl: the
#       batch-1 step plain and with PDL, against the HBM floor.
#   scripts/gpu-pdl.sh tp
#       nvidia-h200-x2: scripts/tp_step.py, TP 1 and TP 2 at batch 1, plain and with PDL,
#       every rank's kernel table (issue 23's 0.65x).
# Carry .whl and .gpu-assets/smollm2-tokenizer. Results in $OUT: pdl-tests.txt,
# pdl.jsonl (or tp-step.jsonl), pdl-stderr.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == tp ]]; then
  STEP_TIMEOUT=${STEP_TIMEOUT:-500} exec scripts/gpu-tp.sh step llama3-8b-shape 1 --pdl \
    --variant-tp 1,2 --kernels 8
fi
source scripts/gpu-env.sh
timeout 240 python3 -m pytest -q -ra -p no:cacheprovider tests/gpu/test_turbo_pdl_gpu.py 2>&1 \
  | tail -12 | tee "$out/pdl-tests.txt"
python3 setup.py -q build_ext --inplace 2>&1 | tail -3  # lmd-bench imports lmd._native
IFS=, read -ra shapes <<<"${1:-llama3-8b-shape,qwen3-8b-shape}"
for shape in "${shapes[@]}"; do
  [[ -f /tmp/$shape/config.json ]] ||
    python3 scripts/random_models.py "$shape" --out-dir /tmp 2>&1 | grep -v "^Writing" | tail -2
  timeout 240 python3 scripts/families_bench.py "/tmp/$shape" --batches 1 --pdl \
    2>>"$out/pdl-stderr.txt" | tee -a "$out/pdl.jsonl"
  rm -rf "/tmp/$shape"  # 16 GB each: the disk holds one at a time
done
grep -E "Error|error" "$out/pdl-stderr.txt" | tail -5
