#!/usr/bin/env bash
# o's weights asked into L2 ahead of it (kernels/l2_prefetch.py) on a GPU machine (the
# device tool), nvidia-h200, ~7 minutes:
#   scripts/gpu-prefetch.sh [TESTS...]
#       the prefetch's GPU tests and TESTS, scripts/l2_prefetch_bench.py, then the
#       batch-1 step with and without it (families_bench.py --no-prefetch) on the
#       Qwen3-8B shape in bf16 and the Llama-3-8B shape in W4A16.
# Carry .whl and .gpu-assets. Results in $OUT: prefetch-tests.txt, l2-prefetch.txt,
# prefetch.jsonl, prefetch-stderr.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
python3 setup.py -q build_ext --inplace 2>&1 | tail -3  # lmd-bench imports lmd._native
timeout 240 python3 -m pytest -q -ra -p no:cacheprovider --timeout 200 tests/gpu/test_l2_prefetch_gpu.py \
  tests/gpu/test_turbo_batch1_fused_gpu.py "$@" 2>&1 | grep -v "^Writing" | tail -12 \
  | tee "$out/prefetch-tests.txt"
timeout 120 python3 scripts/l2_prefetch_bench.py 2>&1 | tee "$out/l2-prefetch.txt"
for run in "qwen3-8b-shape" "llama3-8b-shape --quantization w4a16"; do
  read -r shape flags <<<"$run"
  python3 scripts/random_models.py "$shape" --out-dir /tmp 2>&1 | grep -v "^Writing" | tail -2
  # shellcheck disable=SC2086  # flags: words
  timeout 200 python3 scripts/families_bench.py "/tmp/$shape" --batches 1 --no-prefetch $flags \
    2>>"$out/prefetch-stderr.txt" | tee -a "$out/prefetch.jsonl"
  rm -rf "/tmp/$shape"  # 16 GB each: the disk holds one at a time
done
grep -E "Error|error" "$out/prefetch-stderr.txt" | tail -5
