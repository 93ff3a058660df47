#!/usr/bin/env bash
# Quantization on a GPU machine (the device tool): tests, kernel timings, the quality
# figures on SmolLM2's real weights, and lmd's offline engine per setting.
#   scripts/gpu-quant.sh tests [FILES...]
#       tests/gpu's quantization tests and the quantized kernels' unit tests compiled (or
#       FILES). Copies .gpu-assets/smol-part-aa to /tmp when carried (the first half of
#       SmolLM2's GGUF, for `quality`).
#   scripts/gpu-quant.sh kernels
#       the kernel timings (w4a16_tiles, fp8_bench, kv_quant_bench).
#   scripts/gpu-quant.sh quality
#       joins /tmp/smol-part-aa and .gpu-assets/smol-part-ab (carry that one: 98 MB do
#       not fit one call) and runs scripts/quant_quality.py on it.
#   scripts/gpu-quant.sh bench SHAPE BATCHES [FLAGS...]
#       scripts/families_bench.py on a random_models.py shape, FLAGS e.g.
#       --quantization w4a16 or --kv-cache-dtype int8.
#   scripts/gpu-quant.sh profile SHAPE [FLAGS...]
#       scripts/prefill_profile.py (a 16 x 512 prefill step's kernels) on that shape.
#   scripts/gpu-quant.sh step SHAPE BATCH [FLAGS...]
#       scripts/step_profile.py (a decode step's phases and its 12 costliest kernels).
#   scripts/gpu-quant.sh experts [TOKENS]
#       ~6 minutes: the FP8 experts' tests compiled, scripts/moe_tiles.py at TOKENS
#       (default 512,1024) with 16-bit experts, FP8 rows and FP8 blocks, then a 1 x 512
#       prefill of 12 layers of the Qwen3-30B-A3B shape profiled, bf16 and fp8
#       (scripts/prefill_profile.py). Carry .gpu-assets too.
#   scripts/gpu-quant.sh experts4 [tests|layers|model]...
#       ~7 minutes: the 4-bit experts' and the grouped GEMM's tests compiled (the native
#       experts kernels' among them; tests), scripts/moe_tiles.py --profile with 4-bit
#       experts at 1-4,096 tokens (the native kernels: 8- and 16-row blocks, 64 on Hopper),
#       without the wgmma kernel (Triton tiles, dequantized slabs from 128-row blocks) and
#       with bf16 experts at 300-4,096 (layers), then families_bench.py on 12 layers of the
#       Qwen3-30B-A3B shape at batches 1, 64 and 256, --quantization w4a16 and bf16
#       (model). All three without arguments. Carry .gpu-assets too.
#   scripts/gpu-quant.sh slabs
#       ~3 minutes: 4-bit experts' dequantized slabs alone (their tests, a layer at 1,024
#       and 4,096 tokens profiled, 12 layers at batches 64 and 256 under w4a16).
# Carry .whl (device-wheels.sh setproctitle gguf accelerate). Results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
what=$1
case $what in
tests)  # tests [PYTEST FILES...]: default the quantization tests, compiled
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3  # the W4A16 tests import lmd._native
  [[ -f .gpu-assets/smol-part-aa ]] && cp .gpu-assets/smol-part-aa /tmp/
  shift
  files=("$@")
  ((${#files[@]})) || files=(tests/gpu/test_w4a16_gpu.py tests/gpu/test_w4a16_rows_gpu.py tests/gpu/test_fp8_gpu.py
    tests/gpu/test_kv_quant_gpu.py tests/unit/test_turbo_quant.py tests/unit/test_turbo_w4a16.py
    tests/unit/test_turbo_fp8.py tests/unit/test_turbo_kv_quant.py)
  timeout 300 python3 -m pytest -q -ra -p no:cacheprovider --timeout 200 "${files[@]}" 2>&1 \
    | grep -v "^Writing\|^Loading" | tee -a "$out/quant-tests.txt" | tail -15
  ;;
kernels)  # the kernel timings
  for script in w4a16_tiles fp8_bench kv_quant_bench; do
    timeout 60 python3 "scripts/$script.py" 2>&1 | tee "$out/$script.txt" | tail -40
  done
  ;;
quality)
  cat /tmp/smol-part-aa .gpu-assets/smol-part-ab >/tmp/smollm2.gguf || exit 1
  md5sum /tmp/smollm2.gguf
  timeout 500 python3 scripts/quant_quality.py /tmp/smollm2.gguf 2>"$out/quality-stderr.txt" \
    | tee "$out/quality.jsonl"
  tail -5 "$out/quality-stderr.txt"
  ;;
experts)
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3
  timeout 240 python3 -m pytest -q -ra -p no:cacheprovider --timeout 200 \
    tests/unit/test_turbo_fp8_experts.py tests/unit/test_turbo_quant_checkpoints.py \
    tests/unit/test_turbo_moe.py tests/unit/test_turbo_moe_vector.py \
    tests/unit/test_turbo_parallel_quant.py 2>&1 | tee "$out/experts-tests.txt" | tail -15
  for fp8 in "" "--fp8 rows" "--fp8 blocks"; do
    # shellcheck disable=SC2086  # $fp8: none, or the flag and its value
    timeout 90 python3 scripts/moe_tiles.py --tokens "${2:-512,1024}" $fp8 2>&1 \
      | tee -a "$out/moe-tiles.txt" | tail -12
  done
  model=/dev/shm/qwen3-30b-a3b-shape-12l
  python3 scripts/random_models.py qwen3-30b-a3b-shape --layers 12 --out-dir /dev/shm \
    --tokenizer .gpu-assets/qwen3-tokenizer 2>&1 | grep -v "^Writing" | tail -2
  for quant in "" "--quantization fp8"; do
    # shellcheck disable=SC2086
    timeout 100 python3 scripts/prefill_profile.py "$model" --prompts 1 --top 12 $quant \
      2>>"$out/bench-stderr.txt" | tee -a "$out/prefill-profile.txt"
  done
  ;;
experts4)
  shift
  parts=" ${*:-tests layers model} "
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3
  if [[ $parts == *" tests "* ]]; then
    timeout 240 python3 -m pytest -q -ra -p no:cacheprovider --timeout 140 \
      tests/gpu/test_w4a16_experts_gpu.py tests/unit/test_turbo_w4a16_experts.py \
      tests/unit/test_turbo_moe.py tests/unit/test_turbo_fp8_experts.py 2>&1 \
      | tee "$out/experts4-tests.txt" | tail -8
  fi
  if [[ $parts == *" layers "* ]]; then
    for flags in "--tokens 1,64,256,300,1024,4096 --w4a16 128" \
      "--tokens 300,1024,4096 --w4a16 128 --no-wgmma" "--tokens 300,1024,4096"; do
      # shellcheck disable=SC2086  # $flags: the flags and their values
      timeout 60 python3 scripts/moe_tiles.py $flags --profile 2>&1 \
        | grep -v "_warn_once\|UserWarning" | tee -a "$out/moe-tiles-w4.txt"
    done
  fi
  [[ $parts == *" model "* ]] || exit 0
  model=/dev/shm/qwen3-30b-a3b-shape-12l
  python3 scripts/random_models.py qwen3-30b-a3b-shape --layers 12 --out-dir /dev/shm \
    --tokenizer .gpu-assets/qwen3-tokenizer 2>&1 | grep -v "^Writing" | tail -2
  for quant in "--quantization w4a16" ""; do
    # shellcheck disable=SC2086  # $quant: none, or the flag and its value
    timeout 130 python3 scripts/families_bench.py "$model" --batches 1,64,256 $quant \
      2>>"$out/bench-stderr.txt" | tee -a "$out/quant-bench.jsonl"
  done
  ;;
slabs)  # the dequantized slabs of 4-bit experts alone: their tests, a layer, 12 layers
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3
  timeout 100 python3 -m pytest -q -ra -p no:cacheprovider --timeout 90 -k "slabs or fused_moe" \
    tests/gpu/test_w4a16_experts_gpu.py tests/unit/test_turbo_w4a16_experts.py 2>&1 | tail -3
  timeout 40 python3 scripts/moe_tiles.py --tokens 1024,4096 --w4a16 128 --profile 2>&1 \
    | grep -v "_warn_once\|UserWarning" | tee -a "$out/moe-tiles-w4.txt"
  model=/dev/shm/qwen3-30b-a3b-shape-12l
  python3 scripts/random_models.py qwen3-30b-a3b-shape --layers 12 --out-dir /dev/shm \
    --tokenizer .gpu-assets/qwen3-tokenizer 2>&1 | grep -v "^Writing" | tail -2
  timeout 100 python3 scripts/families_bench.py "$model" --batches 64,256 --quantization w4a16 \
    2>>"$out/bench-stderr.txt" | tee -a "$out/quant-bench.jsonl"
  ;;
bench|profile|step)
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3  # lmd-bench imports lmd._native
  shape=$2
  shift 2
  model=/tmp/$shape
  if [[ ! -f $model/config.json ]]; then
    python3 scripts/random_models.py "$shape" --out-dir /tmp 2>&1 | grep -v "^Writing" | tail -2
  fi
  if [[ $what == profile ]]; then
    timeout 200 python3 scripts/prefill_profile.py "$model" --top 10 "$@" \
      2>>"$out/bench-stderr.txt" | tee -a "$out/prefill-profile.txt"
  elif [[ $what == step ]]; then
    batch=$1
    shift
    timeout 200 python3 scripts/step_profile.py "$model" --batch "$batch" --kernels 12 "$@" \
      2>>"$out/bench-stderr.txt" | tee -a "$out/step-profile.txt"
  else
    batches=$1
    shift
    timeout 560 python3 scripts/families_bench.py "$model" --batches "$batches" "$@" \
      2>>"$out/bench-stderr.txt" | tee -a "$out/quant-bench.jsonl"
  fi
  grep -E "Error|error" "$out/bench-stderr.txt" | tail -5
  ;;
esac
