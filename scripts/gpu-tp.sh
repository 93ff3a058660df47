#!/usr/bin/env bash
# Tensor parallelism (issue 23) on a machine of two or more GPUs (the device tool's
# nvidia-h100-x2 / nvidia-h200-x2; ask `status` first):
#   scripts/gpu-tp.sh tests [PYTEST ARGS]
#       tests/gpu/test_tensor_parallel_gpu.py (TP 2 = TP 1 in float32: turbo eager, turbo
#       with CUDA graphs, torch; bf16 TP 2 against transformers float32) and the torch
#       backend's CPU TP test on that machine's transformers (test_torch_parallel.py).
#   scripts/gpu-tp.sh step SHAPE [BATCHES [TP_STEP FLAGS...]]
#       scripts/tp_step.py: the decode step (CUDA graphs) on TP 1 and TP 2, batch 1 and
#       64 by default, SHAPE a scripts/random_models.py shape (llama3-8b-shape).
#   scripts/gpu-tp.sh serve SHAPE TP [FLAGS...]
#       lmdd serve --mode hybrid --tp TP on the shape, then lmd-bench serve at $RUNS
#       (gpu-env.sh serve_runs: 512 in / 256 out, ignore_eos). llama3-70b-shape (141 GB,
#       written streamed into /dev/shm) needs two H200s: kind nvidia-h200-x2.
#   scripts/gpu-tp.sh prepare SHAPE
#       only write the shape's random checkpoint.
#   scripts/gpu-tp.sh big
#       one device call of ~9 minutes: the 70B shape written in the background while the
#       8B shape serves on TP 2 ($OUT/8b), then the 70B served on TP 2 with turbo.
# Carry .whl and .gpu-assets. Results in $OUT (tp-tests.txt, tp-step.jsonl, tp-serve-*).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
what=$1
nvidia-smi topo -m >"$out/topology.txt" 2>&1
if [[ $what == tests ]]; then
  timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -q -ra -p no:cacheprovider --timeout 500 -s \
    tests/gpu/test_tensor_parallel_gpu.py tests/unit/test_torch_parallel.py "${@:2}" 2>&1 \
    | grep -v "^Writing\|^Loading" | tee "$out/tp-tests.txt" | tail -25
  exit 0
fi
if [[ $what == big ]]; then
  "$0" prepare llama3-70b-shape >"$out/write70.log" 2>&1 &
  writer=$!
  RUNS=32:128 timeout 200 "$0" serve llama3-8b-shape 2
  pkill -f "[l]md serve"
  mkdir -p "$out/8b" && mv "$out"/tp-serve* "$out"/serve-c* "$out/8b/"
  wait $writer
  echo "70B written after $SECONDS s"
  RUNS=${RUNS_70B:-16:64 64:128} timeout 380 "$0" serve llama3-70b-shape 2 \
    --decode-backend turbo --startup-timeout 900
  pkill -f "[l]md serve"
  exit 0
fi
python3 setup.py -q build_ext --inplace 2>&1 | tail -3  # lmdd imports lmd._native
shape=$2
dir=/tmp
if [[ $shape == llama3-70b* ]]; then  # 138 GB: more than the disk (written streamed)
  dir=/dev/shm  # tmpfs, half the RAM by default: grown to hold it
  (($(df -BG --output=size /dev/shm | tail -1 | tr -dc 0-9) < 170)) && mount -o remount,size=170G /dev/shm
  df -h /dev/shm | tail -1
fi
model=$dir/$shape
[[ -f $model/config.json ]] || python3 scripts/random_models.py "$shape" --vocab 49152 \
  --tokenizer .gpu-assets/smollm2-tokenizer --out-dir "$dir" 2>&1 |
  grep -v "^Writing\|^Loading" | tail -3
[[ $what == prepare ]] && exit 0
if [[ $what == step ]]; then
  timeout "${STEP_TIMEOUT:-560}" python3 scripts/tp_step.py "$model" --tp 1,2 --batches "${3:-1,64}" "${@:4}" \
    2>"$out/tp-step-stderr.txt" | tee -a "$out/tp-step.jsonl"
  grep -E "Error|error" "$out/tp-step-stderr.txt" | tail -5
  exit 0
fi
tp=$3
shift 3
rt=/tmp/lmd-tp$tp port=24000
python3 -m lmd serve "$model" --mode hybrid --tp "$tp" --runtime-dir "$rt" --port $port "$@" \
  >"$out/tp-serve-$tp-daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 1800); do  # up to 15 min: a 70B group loads 69 GB a rank
  curl -sf localhost:$port/health >/dev/null && break
  kill -0 $daemon 2>/dev/null || { tail -20 "$out/tp-serve-$tp-daemon.log"; exit 1; }
  sleep 0.5
done
echo "ready after $SECONDS s"
serve_runs $port "tp$tp-$shape" "$out" | tee "$out/tp-serve-$tp.txt"
python3 -m lmd_client.lmdctl --socket "$rt/control.sock" status >>"$out/tp-serve-$tp.txt"
python3 -m lmd_client.lmdctl --socket "$rt/control.sock" shutdown >/dev/null
wait
