#!/usr/bin/env bash
# A batch-1 decode step's launches on a GPU machine (the device tool):
#   scripts/gpu-batch1.sh [SHAPES]
#       nvidia-h200, ~6 minutes: the GPU tests of the folded activation and of decode
#       attention, then for each random_models.py shape (default
#       llama3-8b-shape,qwen3-8b-shape) scripts/families_bench.py --batches 1
#       --separate-activation: the batch-1 step, and again with the activation in a
#       kernel of its own, against the HBM floor.
#   scripts/gpu-batch1.sh tp
#       nvidia-h200-x2: the peer exchange's GPU tests, then scripts/tp_step.py at batch 1,
#       TP 1 and TP 2; at TP 2 also with the activation in its own kernel and through
#       NCCL; every rank's kernel table (issue 23's 0.65x).
#   scripts/gpu-batch1.sh experts [LAYERS]
#       nvidia-h200, ~6 minutes: the GPU tests of a layer of experts at batch 1
#       (kernels/moe_vector.py), gemv_bench.py --experts (its kernels' tilings), then the
#       batch-1 step of the first LAYERS (default 12) layers of the Qwen3-30B-A3B shape
#       with it and through kernels/moe.py's path (families_bench.py --separate-experts),
#       and its kernels (step_profile.py).
#   scripts/gpu-batch1.sh products [TESTS...]
#       nvidia-h200, ~5 minutes: TESTS (GPU tests), scripts/gemv_bench.py --plain (o and
#       down at one row, gemv's tilings against vector_gemv's), then the Qwen3-8B
#       shape's batch-1 step phase by phase with its 16 costliest kernels.
#   scripts/gpu-batch1.sh plain [TESTS...]
#       nvidia-h200, ~8 minutes: TESTS, scripts/gemv_bench.py's sweep of the normed
#       products at Qwen3's shapes, then the batch-1 step with o and down through
#       vector_gemv and through gemv (families_bench.py --gemv-plain) on the Qwen3-8B
#       shape and the first 12 layers of the Qwen3-30B-A3B shape.
#   scripts/gpu-batch1.sh rotary [TESTS...]
#       nvidia-h200, ~6 minutes: TESTS, gemv_bench.py's sweep of gate|up with its
#       activation (Qwen3-8B, Llama-3-8B) and of Llama-3-8B's normed products, then the
#       batch-1 step with a token's heads rotated in one program and spread over five
#       (families_bench.py --rotary-whole) on the Qwen3-8B shape and the first 12
#       layers of the Qwen3-30B-A3B shape.
#   scripts/gpu-batch1.sh tiles [TESTS...]
#       nvidia-h200, ~4 minutes: TESTS, then the batch-1 step with vector_gemv's H200
#       tiles and with the H100's (families_bench.py --h100-tiles) on the same two shapes.
#   scripts/gpu-batch1.sh fused [TESTS...]
#       nvidia-h200, ~6 minutes: TESTS, then the batch-1 step with the rotary in qkv's
#       launch and the merge in decode attention's, and with each in a kernel of its own
#       (families_bench.py --separate-rotary --separate-merge --separate-rotary-merge) on
#       the same two shapes.
#   scripts/gpu-batch1.sh norms [TESTS...]
#       nvidia-h200, ~6 minutes: TESTS, scripts/w4a16_normed_bench.py (the normed launch
#       alone against the norm's and SiLU's own), then the batch-1 step under --quantization w4a16
#       of the Llama-3-8B shape and of the first 12 layers of Qwen3-30B-A3B, with the
#       norms and SiLU's gate in the 4-bit products' launches and apart
#       (families_bench.py --separate-w4a16-norms --separate-w4a16-silu).
#   scripts/gpu-batch1.sh moe48 [FLAGS...]
#       nvidia-h200, ~5 minutes: the whole Qwen3-30B-A3B shape written streamed into
#       /dev/shm (57 GB, ~85 s), then families_bench.py at batch 1 (the step against its
#       floor) and at 256 (each in an engine of its own; BATCHES="1 64" others; each of
#       FLAGS, e.g. "--quantization w4a16" "", a run of its own), and step_profile.py at 256
#       and at 1 and prefill_profile.py at 16 x 512 tokens (PROFILES=0: not).
# Carry .whl and .gpu-assets (scripts/gpu-assets.sh makes it). Results in $OUT: batch1-tests.txt,
# batch1.jsonl (or tp-step.jsonl), batch1-stderr.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == tp ]]; then
  TESTS_TIMEOUT=150 scripts/gpu-tp.sh tests tests/unit/test_turbo_exchange.py -k exchange
  STEP_TIMEOUT=${STEP_TIMEOUT:-380} exec scripts/gpu-tp.sh step llama3-8b-shape 1 \
    --separate-activation --nccl-batch1 --variant-tp 2 --kernels 8
fi
source scripts/gpu-env.sh
if [[ ${1:-} == moe48 ]]; then
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3
  model=/dev/shm/qwen3-30b-a3b-shape
  [[ -f $model/config.json ]] || python3 scripts/random_models.py qwen3-30b-a3b-shape --streamed \
    --out-dir /dev/shm 2>&1 | grep -v "^Writing" | tail -2
  shift
  for batch in ${BATCHES:-1 256}; do
    for flags in "${@:-}"; do  # each a run of its own (default: bf16 alone)
      # shellcheck disable=SC2086  # flags: words
      timeout 260 python3 scripts/families_bench.py "$model" --batches $batch $flags \
        2>>"$out/batch1-stderr.txt" | tee -a "$out/moe48.jsonl"
    done
  done
  [[ ${PROFILES:-1} == 0 ]] && exit 0
  for batch in 256 1; do
    timeout 120 python3 scripts/step_profile.py "$model" --batch $batch --kernels 14 \
      2>>"$out/batch1-stderr.txt" | tee "$out/step$batch-profile.txt"
  done
  timeout 120 python3 scripts/prefill_profile.py "$model" --prompts 16 --top 14 \
    2>>"$out/batch1-stderr.txt" | tee -a "$out/prefill-profile.txt"
  grep -E "Error|error" "$out/batch1-stderr.txt" | tail -5
  exit 0
fi
if [[ ${1:-} == norms ]]; then
  shift
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3
  if (($#)); then
    timeout 300 python3 -m pytest -q -ra -p no:cacheprovider --timeout 200 "$@" 2>&1 \
      | grep -v "^Writing" | tee "$out/batch1-tests.txt" | tail -25
  fi
  (cd scripts && timeout 150 python3 w4a16_normed_bench.py 2>&1) | tee "$out/normed-bench.txt"
  python3 scripts/random_models.py llama3-8b-shape --out-dir /tmp 2>&1 | grep -v "^Writing" | tail -2
  python3 scripts/random_models.py qwen3-30b-a3b-shape --layers 12 --out-dir /tmp 2>&1 \
    | grep -v "^Writing" | tail -2
  for model in /tmp/llama3-8b-shape /tmp/qwen3-30b-a3b-shape-12l; do
    timeout 240 python3 scripts/families_bench.py "$model" --batches 1 --quantization w4a16 \
      --separate-w4a16-norms --separate-w4a16-silu 2>>"$out/batch1-stderr.txt" \
      | tee -a "$out/batch1.jsonl"
  done
  grep -E "Error|error" "$out/batch1-stderr.txt" | tail -5
  exit 0
fi
if [[ ${1:-} =~ ^(products|plain|rotary|tiles|fused)$ ]]; then
  mode=$1
  shift
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3
  if (($#)); then
    timeout 300 python3 -m pytest -q -ra -p no:cacheprovider --timeout 200 "$@" 2>&1 \
      | grep -v "^Writing" | tee "$out/batch1-tests.txt" | tail -25
  fi
  if [[ $mode == products ]]; then
    timeout 150 python3 scripts/gemv_bench.py --plain 2>&1 | tee "$out/gemv-plain.txt"
    python3 scripts/random_models.py qwen3-8b-shape --out-dir /tmp 2>&1 | grep -v "^Writing" | tail -2
    timeout 150 python3 scripts/step_profile.py /tmp/qwen3-8b-shape --batch 1 --kernels 16 \
      2>>"$out/batch1-stderr.txt" | tee "$out/step-profile.txt"
    grep -E "Error|error" "$out/batch1-stderr.txt" | tail -5
    exit 0
  fi
  sweep="--shapes qwen3,qwen3moe" switch=--gemv-plain
  [[ $mode == rotary ]] && sweep="--shapes qwen3-gated,llama-gated,llama" switch=--rotary-whole
  [[ $mode == tiles ]] && sweep="" switch=--h100-tiles
  [[ $mode == fused ]] && sweep="" switch="--separate-rotary --separate-merge --separate-rotary-merge"
  # shellcheck disable=SC2086  # sweep: words
  [[ -n $sweep ]] &&
    timeout 150 python3 scripts/gemv_bench.py $sweep 2>&1 | tee "$out/gemv-sweep.txt"
  for shape in qwen3-8b-shape "qwen3-30b-a3b-shape --layers 12"; do
    read -r name flags <<<"$shape"
    # shellcheck disable=SC2086  # flags: words
    python3 scripts/random_models.py $name $flags --out-dir /tmp 2>&1 | grep -v "^Writing" | tail -2
  done
  for model in /tmp/qwen3-8b-shape /tmp/qwen3-30b-a3b-shape-12l; do
    timeout 200 python3 scripts/families_bench.py "$model" --batches 1 $switch \
      2>>"$out/batch1-stderr.txt" | tee -a "$out/batch1.jsonl"
  done
  grep -E "Error|error" "$out/batch1-stderr.txt" | tail -5
  exit 0
fi
if [[ ${1:-} == experts ]]; then
  { timeout 80 python3 -m pytest -q -ra -p no:cacheprovider tests/unit/test_turbo_moe_vector.py \
      tests/unit/test_turbo_moe.py 2>&1 | tail -4
    timeout 90 python3 -m pytest -q -ra -p no:cacheprovider tests/gpu/test_turbo_families_gpu.py \
      tests/gpu/test_turbo_batch1_fused_gpu.py -k "moe or mixtral" 2>&1 | tail -6
  } | tee "$out/batch1-tests.txt"
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3
  timeout 150 python3 scripts/gemv_bench.py --experts 2>&1 | tee "$out/gemv-sweep.txt"
  python3 scripts/random_models.py qwen3-30b-a3b-shape --layers "${2:-12}" --out-dir /tmp 2>&1 |
    grep -v "^Writing" | tail -2
  model=/tmp/qwen3-30b-a3b-shape-${2:-12}l
  timeout 150 python3 scripts/families_bench.py "$model" --batches 1 \
    --separate-experts 2>>"$out/batch1-stderr.txt" | tee -a "$out/batch1.jsonl"
  timeout 120 python3 scripts/step_profile.py "$model" --batch 1 --kernels 16 \
    2>>"$out/batch1-stderr.txt" | tee "$out/step-profile.txt"
  grep -E "Error|error" "$out/batch1-stderr.txt" | tail -5
  exit 0
fi
timeout 300 python3 -m pytest -q -ra -p no:cacheprovider tests/gpu/test_turbo_batch1_fused_gpu.py \
  tests/gpu/test_turbo_kernels_gpu.py tests/gpu/test_kv_quant_gpu.py tests/unit/test_turbo_gemv.py \
  tests/gpu/test_turbo_backend_gpu.py 2>&1 \
  | grep -v "^Writing" | tail -12 | tee "$out/batch1-tests.txt"
python3 setup.py -q build_ext --inplace 2>&1 | tail -3  # lmd-bench imports lmd._native
IFS=, read -ra shapes <<<"${1:-llama3-8b-shape,qwen3-8b-shape}"
for shape in "${shapes[@]}"; do
  [[ -f /tmp/$shape/config.json ]] ||
    python3 scripts/random_models.py "$shape" --out-dir /tmp 2>&1 | grep -v "^Writing" | tail -2
  timeout 240 python3 scripts/families_bench.py "/tmp/$shape" --batches 1 --separate-activation \
    2>>"$out/batch1-stderr.txt" | tee -a "$out/batch1.jsonl"
  rm -rf "/tmp/$shape"  # 16 GB each: the disk holds one at a time
done
grep -E "Error|error" "$out/batch1-stderr.txt" | tail -5
