#!/usr/bin/env bash
# Where served time goes (issue 24): lmdd serve on one GPU, then lmd-bench serve
# (streaming /v1/completions, 512 in / 256 out, ignore_eos) at each concurrency, with the
# daemon's per-stage breakdown and each worker's CPU (lmd-bench serve's `stages`).
#   scripts/gpu-stages.sh SHAPE MODE [LABEL [FLAGS...]]
#       SHAPE llama3-8b-shape or smollm2-shape (random bf16 weights, the SmolLM2
#       tokenizer), MODE disaggregated or hybrid, FLAGS passed to lmdd serve;
#       RUNS="C:N[:P] ..." (default "64:256 256:1024"): concurrency, requests and
#       client processes (lmd-bench serve --client-processes; default CLIENTS, else 1).
# Carry .whl and .gpu-assets. Results: $OUT/stages-LABEL.txt (each run's summary with
# its breakdown) and $OUT/LABEL.tgz (the JSON of each run, status, daemon log).
set -uo pipefail
source scripts/gpu-env.sh
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
shape=$1 mode=$2 label=${3:-$1-$2}
shift 3 2>/dev/null || shift $#
model=/tmp/$shape
[[ -d $model ]] || python3 scripts/random_models.py "$shape" --vocab 49152 \
  --tokenizer .gpu-assets/smollm2-tokenizer >/dev/null 2>&1
rt=/tmp/lmd-$label port=24000
summary=$out/stages-$label.txt
all=$out && out=/tmp/out-$label && mkdir -p "$out"
python3 -m lmd serve $model --mode "$mode" --runtime-dir "$rt" --port $port "$@" \
  >"$out/daemon.log" 2>&1 &
start=$SECONDS
for _ in $(seq 600); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.5; done
echo "== $label ($shape, $mode, flags: $*): /health 200 after $((SECONDS - start)) s" |
  tee "$summary"
serve_runs $port "$label" "$out" | tee -a "$summary"
python3 -m lmd_client.lmdctl --socket "$rt/control.sock" --json status >"$out/status.json"
grep -E "Traceback|Error|cannot start|out of GPU memory" "$out/daemon.log" | head -10 |
  tee -a "$summary"
python3 -m lmd_client.lmdctl --socket "$rt/control.sock" shutdown >/dev/null
wait
tar -czf "$all/$label.tgz" -C /tmp "out-$label"
