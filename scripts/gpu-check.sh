#!/usr/bin/env bash
# One call on a GPU machine (the device tool): install the carried wheels, build
# lmd._native, run tests/gpu, and time the engine. Results land in $OUT (or ./gpu-out).
# Needs: scripts/../.whl from ../shared/scripts/device-wheels.sh with the extra names
# scripts/gpu-env.sh lists (the tests' among them), carried as `.whl`.
#   scripts/gpu-check.sh [quick|full|migration]   quick: tests only; full: also the
#   Llama-3-8B shape; migration: the cuda_ipc tests, lmd-bench migration, and TTFT of a
#   ~2k-token prompt on a Llama-3-8B shape, hybrid vs disaggregated (carry .gpu-assets:
#   SmolLM2's tokenizer files, see tests/gpu/test_disaggregated_gpu.py)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
python3 setup.py -q build_ext --inplace 2>&1 | tail -5 | tee "$out/build.txt"
if [[ "${1:-}" == "migration" ]]; then
  exec scripts/gpu-migration.sh "$out"
fi
python3 -m pytest -q -ra -p no:cacheprovider tests/gpu tests/unit/test_native_host.py \
  2>&1 | tee "$out/gpu-tests.txt" | tail -25
[[ "${1:-}" == "quick" ]] && exit 0
# Engine throughput with random weights (bf16), the workload of docs/benchmarks.md.
python3 scripts/random_models.py smollm2-shape $([[ "${1:-}" == full ]] && echo llama3-8b-shape)
bench() {
  python3 -m lmd.bench offline --device cuda --input-len 512 --output-len 256 --json "$@" \
    2>"$out/bench-stderr.txt" | tail -1 | tee -a "$out/offline.jsonl"
}
for batch in 1 64 256 512; do bench --model /tmp/smollm2-shape --batch "$batch"; done
bench --model /tmp/smollm2-shape --batch 64 --compare-hf
if [[ "${1:-}" == "full" ]]; then
  for batch in 1 64 512; do bench --model /tmp/llama3-8b-shape --batch "$batch"; done
  # The KV pool leaves room for transformers' own copy of the 16 GB of weights.
  bench --model /tmp/llama3-8b-shape --batch 64 --compare-hf --cache-max-entry-count 0.3
fi
