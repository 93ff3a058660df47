#!/usr/bin/env bash
# TTFT of ~1,600-token prompts on a Llama-3-8B shape (random bf16 weights), hybrid vs
# disaggregated twice each in one call, with where the time goes in each engine worker
# (stages_ms from lmdctl status --json). Carry .whl and .gpu-assets (see gpu-check.sh).
#   scripts/gpu-ttft.sh
set -uo pipefail
source scripts/gpu-env.sh
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
python3 scripts/random_models.py llama3-8b-shape --vocab 49152 --tokenizer .gpu-assets/smollm2-tokenizer >/dev/null 2>&1
run() {  # label mode
  rt=/tmp/lmd-$1
  python3 -m lmd serve /tmp/llama3-8b-shape --mode "$2" --runtime-dir "$rt" --port 24000 \
    --cache-max-entry-count 0.25 >/tmp/daemon-$1.log 2>&1 &
  for _ in $(seq 180); do curl -sf localhost:24000/health >/dev/null && break; sleep 1; done
  python3 -m lmd.bench serve --url http://127.0.0.1:24000 --endpoint /v1/completions \
    --num-prompts 24 --concurrency 1 --input-len 1600 --output-len 4 --ignore-eos \
    --warmup 3 --label "$1" --out "/tmp/ttft-$1.json" --no-progress | grep -E "^TTFT|^TPOT" | sed "s/^/$1 /"
  sleep 3  # one more heartbeat
  python3 -m lmd_client.lmdctl --socket "$rt/control.sock" --json status | python3 -c "
import json,sys; s=json.load(sys.stdin)
for w in s['workers']:
    if w.get('stages_ms'): print('$1', w['name'], json.dumps(w['stages_ms']))
    if w.get('migration') and 'seconds_sum' in w['migration']: m=w['migration']; print('$1', w['name'], 'copy ms mean', round(1000*m['seconds_sum']/max(m['count'],1),3))
"
  python3 -m lmd_client.lmdctl --socket "$rt/control.sock" shutdown >/dev/null
  wait
}
run hybrid hybrid
run disagg disaggregated
run hybrid2 hybrid
run disagg2 disaggregated
