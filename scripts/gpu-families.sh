#!/usr/bin/env bash
# turbo's newer families on a GPU machine (the device tool): their GPU tests, lmd's
# offline engine, LMDeploy 0.18's PyTorch engine, on random bf16 weights of a shape.
#   scripts/gpu-families.sh tests
#   scripts/gpu-families.sh lmd|lmdeploy SHAPE BATCHES [FLAGS...]
#       SHAPE: a scripts/random_models.py shape (qwen3-8b-shape, qwen3-30b-a3b-shape);
#       BATCHES: e.g. 1,64,512. Prompts 512 in / 256 out, greedy, ignore_eos. FLAGS go
#       to scripts/families_bench.py (lmd: e.g. --separate-activation, --quantization fp8).
# Carry .whl, .gpu-assets (qwen3-tokenizer: a copy of ../shared/assets/tokenizers/qwen3)
# and, for lmdeploy, .lmdeploy (../shared/scripts/lmdeploy-anchor.sh). Results in $OUT:
# families-tests.txt, families.jsonl (lmd's lines, then LMDeploy's), *-stderr.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
what=$1
if [[ $what == tests ]]; then
  timeout 500 python3 -m pytest -q -ra -p no:cacheprovider --timeout 300 -s \
    tests/gpu/test_turbo_families_gpu.py tests/unit/test_turbo_families.py \
    tests/unit/test_turbo_moe.py tests/unit/test_turbo_kernels.py 2>&1 \
    | grep -v "^Writing\|^Loading" | tee "$out/families-tests.txt" | tail -25
  exit 0
fi
python3 setup.py -q build_ext --inplace 2>&1 | tail -3  # lmd-bench imports lmd._native
shape=$2 batches=$3
dir=/tmp
[[ $shape == qwen3-30b* ]] && dir=/dev/shm  # 61 GB: more than the disk leaves
model=$dir/$shape
if [[ ! -f $model/config.json ]]; then
  start=$SECONDS
  python3 scripts/random_models.py "$shape" --out-dir "$dir" \
    --tokenizer .gpu-assets/qwen3-tokenizer 2>&1 | grep -v "^Writing\|^Loading" | tail -3
  echo "$shape built in $((SECONDS - start)) s: $(du -sh "$model" | cut -f1)"
fi
if [[ $what == lmd ]]; then
  timeout 560 python3 scripts/families_bench.py "$model" --batches "$batches" "${@:4}" \
    2>"$out/lmd-$shape-stderr.txt" | tee -a "$out/families.jsonl"
  tail -3 "$out/lmd-$shape-stderr.txt"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lmdsite \
    .lmdeploy/whl/*.whl || exit 1
  tar xzf .lmdeploy/lmdeploy.tgz -C /tmp/lmdsite
  vocab=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" \
    "$model/config.json")
  PYTHONPATH=/tmp/lmdsite:$PYTHONPATH timeout 560 python3 scripts/lmdeploy_offline.py "$model" \
    --batches "$batches" --vocab "$vocab" 2>"$out/lmdeploy-$shape-stderr.txt" \
    | tee -a "$out/families.jsonl"
  grep -E "Error|error" "$out/lmdeploy-$shape-stderr.txt" | tail -5
fi
