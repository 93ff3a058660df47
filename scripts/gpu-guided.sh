#!/usr/bin/env bash
# One call on a GPU machine (the device tool) for structured output (engine/grammar.py):
# its GPU test, then `lmd-bench offline` on the Llama-3-8B shape (random bf16 weights over
# SmolLM2's tokenizer, carried in .gpu-assets) at batch 1 and 64, every request plain or
# following scripts/data/guided-answer.json, alternated. The grammar's cost is the
# ms_per_step of a guided run against a plain one.
# Results in $OUT (or ./gpu-out): guided-tests.txt, offline.jsonl. Needs .whl carried.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
timeout 240 python3 -m pytest -q -ra -p no:cacheprovider --timeout 200 \
  tests/gpu/test_grammar_gpu.py 2>&1 | tee "$out/guided-tests.txt" | grep -v "^Writing\|^Loading" | tail -8
python3 setup.py -q build_ext --inplace 2>&1 | tail -3  # lmd-bench imports lmd._native
python3 scripts/random_models.py llama3-8b-shape --tokenizer .gpu-assets/smollm2-tokenizer
bench() {
  timeout 150 python3 -m lmd.bench offline --device cuda --backend turbo --input-len 512 \
    --output-len 256 --model /tmp/llama3-8b-shape --json "$@" 2>>"$out/bench-stderr.txt" |
    tail -1 | tee -a "$out/offline.jsonl"
}
for batch in 1 64; do
  for round in 1 2; do
    bench --batch $batch
    bench --batch $batch --guided-json scripts/data/guided-answer.json
  done
done
tail -3 "$out/bench-stderr.txt"
