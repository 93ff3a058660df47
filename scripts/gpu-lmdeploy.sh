#!/usr/bin/env bash
# LMDeploy 0.18's api_server (PyTorch engine) on the same random model and the same
# `lmd-bench serve` runs as scripts/gpu-stages.sh, in the same device call: the anchor
# the served-throughput issue compares with (time to first token, tok/s).
#   scripts/gpu-lmdeploy.sh SHAPE [LABEL [api_server FLAGS...]]
#       SHAPE llama3-8b-shape or smollm2-shape; RUNS and CLIENTS as gpu-stages.sh.
# Carry .whl, .gpu-assets and .lmdeploy (../shared/scripts/lmdeploy-anchor.sh). Results:
# $OUT/lmdeploy-LABEL.txt (each run's summary) and $OUT/LABEL.tgz (JSON, server log).
set -uo pipefail
source scripts/gpu-env.sh
shape=$1 label=${2:-lmdeploy-$1}
shift 2 2>/dev/null || shift $#
model=/tmp/$shape
[[ -d $model ]] || python3 scripts/random_models.py "$shape" --vocab 49152 \
  --tokenizer .gpu-assets/smollm2-tokenizer >/dev/null 2>&1
# LMDeploy's own wheels first (its apache-tvm-ffi pin), then lmd's for fastapi & co.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lmdsite \
  .lmdeploy/whl/*.whl || exit 1
tar xzf .lmdeploy/lmdeploy.tgz -C /tmp/lmdsite
port=24100 summary=$out/lmdeploy-$label.txt
all=$out && out=/tmp/out-$label && mkdir -p "$out"
PYTHONPATH=/tmp/lmdsite:/tmp/site setsid python3 -c \
  'import sys; from lmdeploy.cli import run; sys.argv = ["lmdeploy"] + sys.argv[1:]; run()' \
  serve api_server "$model" --backend pytorch --server-port $port "$@" >"$out/server.log" 2>&1 &
server=$!
start=$SECONDS
for _ in $(seq 600); do
  curl -sf localhost:$port/v1/models >/dev/null && break
  kill -0 $server 2>/dev/null || break
  sleep 0.5
done
echo "== $label (LMDeploy 0.18 pytorch, $shape, flags: $*): up after $((SECONDS - start)) s" |
  tee "$summary"
serve_runs $port "$label" "$out" --no-stages | tee -a "$summary"
grep -E "Traceback|Error" "$out/server.log" | head -10 | tee -a "$summary"
kill -- -$server 2>/dev/null
wait $server 2>/dev/null
tar -czf "$all/$label.tgz" -C /tmp "out-$label"
