#!/usr/bin/env bash
# One device call for the wgmma kernel's gated launch (gate|up with its SiLU): build, the
# W4A16 GPU tests, then the Llama-3-8B shape at batch 64 end to end (families_bench.py),
# bf16 once and W4A16 with w4a16_rows.GATED off and on, alternating twice. Results in $OUT.
#   scripts/gpu-gated.sh        (carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh >/dev/null
python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || { tail "$out/build.log"; exit 1; }
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_w4a16_rows_gpu.py \
  tests/gpu/test_w4a16_gpu.py 2>&1 | tail -3
python3 scripts/random_models.py llama3-8b-shape --out-dir /dev/shm >"$out/models.log" 2>&1 ||
  { tail "$out/models.log"; exit 1; }
model=/dev/shm/llama3-8b-shape
timeout 150 python3 scripts/families_bench.py $model --batches 64 >"$out/bf16.txt" 2>&1
grep output_tokens_per_s "$out/bf16.txt"
for round in 1 2; do
  for gated in False True; do
    timeout 150 python3 -c "
import runpy, sys
sys.argv = ['families_bench.py', '$model', '--batches', '64', '--quantization', 'w4a16']
from lmd.engine.turbo.kernels import w4a16_rows
w4a16_rows.GATED = $gated
sys.path.insert(0, 'scripts')
runpy.run_path('scripts/families_bench.py', run_name='__main__')
" >"$out/w4a16-gated-$gated-$round.txt" 2>&1
    echo "GATED=$gated round $round: $(grep -o '"output_tokens_per_s": [0-9.]*' "$out/w4a16-gated-$gated-$round.txt")"
  done
done
