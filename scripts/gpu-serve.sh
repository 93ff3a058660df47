#!/usr/bin/env bash
# Served vs offline output tok/s on one GPU (issue 8's "served within 15% of offline at
# batch 64"): Llama-3-8B shape, random bf16 weights, vocab 49,152 so that the SmolLM2
# tokenizer drives it; turbo backends; 512 prompt / 256 output tokens, ignore_eos.
#   offline: lmd-bench offline --batch 64
#   served:  lmdd serve, prefill and decode processes on the same GPU (and hybrid, for
#            reference), lmd-bench serve --concurrency 64 over streaming /v1/completions
# Carry .whl and .gpu-assets (see gpu-check.sh). Results in $OUT.
#   scripts/gpu-serve.sh
set -uo pipefail
source scripts/gpu-env.sh
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
model=/tmp/llama3-8b-shape
python3 scripts/random_models.py llama3-8b-shape --vocab 49152 \
  --tokenizer .gpu-assets/smollm2-tokenizer >/dev/null 2>&1
python3 -m lmd.bench offline --device cuda --backend turbo --model $model --batch 64 \
  --input-len 512 --output-len 256 2>&1 | tail -4 | tee "$out/offline-b64.txt"
serve() {  # label mode
  rt=/tmp/lmd-$1
  python3 -m lmd serve $model --mode "$2" --runtime-dir "$rt" --port 24000 \
    --cache-max-entry-count 0.3 --max-batch-size 128 >"$out/daemon-$1.log" 2>&1 &
  for _ in $(seq 240); do curl -sf localhost:24000/health >/dev/null && break; sleep 1; done
  python3 -m lmd.bench serve --url http://127.0.0.1:24000 --endpoint /v1/completions \
    --num-prompts 320 --concurrency 64 --input-len 512 --output-len 256 --ignore-eos \
    --warmup 8 --label "$1" --out "$out/serve-$1.json" --no-progress 2>&1 | tail -12 |
    sed "s/^/$1 /"
  [[ $1 == disagg ]] &&  # (8 files come back at most)
    python3 -m lmd_client.lmdctl --socket "$rt/control.sock" --json status >"$out/status-$1.json"
  python3 -m lmd_client.lmdctl --socket "$rt/control.sock" shutdown >/dev/null
  wait
}
serve disagg disaggregated
serve hybrid hybrid
