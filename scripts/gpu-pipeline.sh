#!/usr/bin/env bash
# Issue 25's "pipeline throughput equals lmd-bench offline within 5% at batch 64": both
# on one GPU, the same engine on the same prompts (scripts/pipeline_vs_offline.py: 512
# prompt / 256 output tokens, ignore_eos, greedy; three processes, each building both
# sides and alternating them over 7 runs: --interleave). Random bf16 weights of the benchmark shapes; with .gpu-assets carried, the
# SmolLM2 tokenizer goes in, so the pipeline detokenizes as a user's would. Carry .whl
# (see gpu-check.sh) and .gpu-assets. Results in $OUT (pipeline.txt, pipeline-SHAPE.json).
#   scripts/gpu-pipeline.sh [SHAPE ...]     default: smollm2-shape llama3-8b-shape
set -uo pipefail
source scripts/gpu-env.sh
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
tokenizer=()
if [[ -d .gpu-assets/smollm2-tokenizer ]]; then
  tokenizer=(--vocab 49152 --tokenizer .gpu-assets/smollm2-tokenizer)
fi
shapes=("$@")
[[ ${#shapes[@]} == 0 ]] && shapes=(smollm2-shape llama3-8b-shape)
for shape in "${shapes[@]}"; do
  python3 scripts/random_models.py "$shape" "${tokenizer[@]}" >/dev/null 2>&1
  python3 scripts/pipeline_vs_offline.py --model "/tmp/$shape" --batch 64 --input-len 512 \
    --output-len 256 --interleave --repeats 3 --iterations 7 --out "$out/pipeline-$shape.json" \
    2>&1 | tail -1 |
    sed "s/^/$shape: /" | tee -a "$out/pipeline.txt"
done
