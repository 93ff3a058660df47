#!/usr/bin/env bash
# One call on a GPU machine (the device tool) for overlapped decode steps (engine.py):
# their GPU tests, then `lmd-bench offline` with --overlap on and off, on one host, most
# important first (Llama-3-8B shape at batch 512, SmolLM2 shape at batch 1, then the rest).
# Results in $OUT (or ./gpu-out): overlap-tests.txt, offline.jsonl. Needs .whl carried.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
timeout 150 python3 -m pytest -q -ra -p no:cacheprovider --timeout 120 \
  tests/gpu/test_engine_overlap_gpu.py tests/unit/test_engine_overlap.py \
  2>&1 | tee "$out/overlap-tests.txt" | grep -v "^Writing\|^Loading" | tail -15
python3 setup.py -q build_ext --inplace 2>&1 | tail -3  # lmd-bench imports lmd._native
python3 scripts/random_models.py smollm2-shape llama3-8b-shape
bench() {
  timeout 150 python3 -m lmd.bench offline --device cuda --backend turbo --input-len 512 \
    --output-len 256 --json "$@" 2>>"$out/bench-stderr.txt" | tail -1 | tee -a "$out/offline.jsonl"
}
for overlap in on off; do bench --model /tmp/llama3-8b-shape --batch 512 --overlap $overlap; done
for overlap in on off on off; do bench --model /tmp/smollm2-shape --batch 1 --overlap $overlap; done
bench --model /tmp/llama3-8b-shape --batch 64 --overlap on
bench --model /tmp/smollm2-shape --batch 512 --overlap on
bench --model /tmp/smollm2-shape --batch 64 --overlap on
tail -3 "$out/bench-stderr.txt"
