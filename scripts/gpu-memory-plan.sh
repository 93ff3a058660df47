#!/usr/bin/env bash
# The GPU memory plan (issue 18) on one GPU, with default flags except the model path:
#   scripts/gpu-memory-plan.sh tests
#       the GPU tests of the plan (tests/gpu/test_memory_plan_gpu.py)
#   scripts/gpu-memory-plan.sh serve SHAPE MODE [LABEL [FLAGS...]]
#       SHAPE llama3-8b-shape or smollm2-shape (random bf16 weights, the SmolLM2
#       tokenizer), MODE disaggregated or hybrid; lmdd serve MODEL [FLAGS] then
#       lmd-bench serve (streaming /v1/completions, 512 in / 256 out, ignore_eos) at
#       concurrency 1, 64, 256 and 512 (8, 256, 1024 and 2000 requests; RUNS="C:N ..."
#       for others). Afterwards
#       `lmdctl status --json`: restarts and free KV blocks of every worker.
# Carry .whl and .gpu-assets (see gpu-check.sh). Results in $OUT/LABEL.tgz (serve-cN.json,
# status.json, daemon.log) and $OUT/summary-LABEL.txt (one line per run), also printed.
set -uo pipefail
source scripts/gpu-env.sh
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
if [[ $1 == tests ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_memory_plan_gpu.py 2>&1 |
    tail -40 | tee "$out/tests.txt"
  exit 0
fi
shape=$2 mode=$3 label=${4:-$2-$3}
shift 4 2>/dev/null || shift $#
model=/tmp/$shape
[[ -d $model ]] || python3 scripts/random_models.py "$shape" --vocab 49152 \
  --tokenizer .gpu-assets/smollm2-tokenizer >/dev/null 2>&1
rt=/tmp/lmd-$label
summary=$out/summary-$label.txt
all=$out && out=/tmp/out-$label && mkdir -p "$out"
python3 -m lmd serve $model --mode "$mode" --runtime-dir "$rt" --port 24000 "$@" \
  >"$out/daemon.log" 2>&1 &
start=$SECONDS models=
for _ in $(seq 600); do
  [[ -z $models ]] && curl -sf localhost:24000/v1/models >/dev/null && models=$((SECONDS - start))
  curl -sf localhost:24000/health >/dev/null && break
  sleep 0.5
done
echo "$label: /v1/models 200 after ${models:-?} s, /health 200 after $((SECONDS - start)) s" |
  tee "$summary"
ctl() { python3 -m lmd_client.lmdctl --socket "$rt/control.sock" "$@"; }
for run in ${RUNS:-1:8 64:256 256:1024 512:2000}; do
  c=${run%:*} n=${run#*:}
  python3 -m lmd.bench serve --url http://127.0.0.1:24000 --endpoint /v1/completions \
    --num-prompts "$n" --concurrency "$c" --input-len 512 --output-len 256 --ignore-eos \
    --warmup 4 --label "$label-c$c" --json --no-progress --timeout 600 \
    >"$out/serve-c$c.json" 2>"$out/serve-c$c.err"
  python3 - "$out/serve-c$c.json" "$label" "$c" <<'EOF' | tee -a "$summary"
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(f"{sys.argv[2]} c={sys.argv[3]}: {r['completed']} ok, {r['failed']} failed "
      f"{r['failed_kinds']}, {r['output_throughput']:.0f} out tok/s, ttft p50 "
      f"{r['ttft_ms']['p50']:.0f} ms, itl p99 {r['itl_ms']['p99']:.1f} ms")
EOF
done
ctl --json status >"$out/status.json"
python3 - "$out/status.json" <<'EOF' | tee -a "$summary"
import json, sys
s = json.load(open(sys.argv[1]))
for w in s["workers"]:
    kv, m = w.get("kv"), w.get("memory")
    line = f"{w['name']}: restarts {w['restarts']}"
    if kv:
        line += f", KV free {kv['free_blocks']}/{kv['total_blocks']}"
    if m:
        gib = {k: round(v / 2**30, 2) for k, v in m.items() if k.endswith("_bytes")}
        line += f", plan {gib} blocks {m['kv_blocks']}"
    print(line)
EOF
grep -E "memory (plan|profile)|out of GPU memory|Traceback|Error|cannot start" \
  "$out/daemon.log" | head -20 | tee -a "$summary"
ctl shutdown >/dev/null
wait
tar -czf "$all/$label.tgz" -C /tmp "out-$label"
