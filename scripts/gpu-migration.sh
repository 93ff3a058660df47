#!/usr/bin/env bash
# KV migration on a GPU machine; run through `scripts/gpu-check.sh migration`, which
# installs the wheels, sets PYTHONPATH and builds lmd._native first. Writes to $1.
# LMD_GPU_SKIP_BENCH=1 skips the transfer benchmarks (tests and TTFT only).
set -uo pipefail
out=$1
ngpu=$(nvidia-smi -L | wc -l)
python3 -m pytest -q -ra -p no:cacheprovider tests/gpu/test_disaggregated_gpu.py \
  tests/gpu/test_native_cuda_ipc.py 2>&1 | tee "$out/migration-tests.txt" | tail -15
bench() {
  [[ -n "${LMD_GPU_SKIP_BENCH:-}" ]] && return
  python3 -m lmd.bench migration --json "$@" | tail -1 | tee -a "$out/migration.jsonl"
}
for kb in 128 1024 4096; do bench --transport cuda_ipc --size-mb 256 --block-kb "$kb"; done
bench --transport cuda_ipc --size-mb 256 --block-kb 128 --direct-copies
bench --transport host --size-mb 256 --block-kb 1024
if (( ngpu > 1 )); then
  bench --transport cuda_ipc --src-device cuda:0 --dst-device cuda:1 --size-mb 256 --block-kb 1024
fi
# TTFT of a ~2k-token prompt, hybrid vs disaggregated, on a Llama-3-8B shape (random
# bf16 weights; vocabulary cut to SmolLM2's tokenizer, whose files are carried).
python3 scripts/random_models.py llama3-8b-shape --vocab 49152 \
  --tokenizer .gpu-assets/smollm2-tokenizer
for mode in hybrid disaggregated; do
  rt=/tmp/lmd-$mode
  python3 -m lmd serve /tmp/llama3-8b-shape --mode "$mode" --runtime-dir "$rt" --port 24000 \
    --cache-max-entry-count 0.25 >"$out/daemon-$mode.log" 2>&1 &
  for _ in $(seq 180); do curl -sf localhost:24000/health >/dev/null && break; sleep 1; done
  python3 -m lmd.bench serve --url http://127.0.0.1:24000 --endpoint /v1/completions \
    --num-prompts 12 --concurrency 1 --input-len 1600 --output-len 4 --ignore-eos \
    --warmup 2 --label "$mode" --out "$out/ttft-$mode.json" --no-progress | tee -a "$out/ttft.txt"
  python3 -m lmd_client.lmdctl --socket "$rt/control.sock" --json status >"$out/status-$mode.json"
  python3 -m lmd_client.lmdctl --socket "$rt/control.sock" shutdown
  wait
done
python3 -m lmd.bench compare "$out/ttft-hybrid.json" "$out/ttft-disaggregated.json" \
  | tee -a "$out/ttft.txt"
