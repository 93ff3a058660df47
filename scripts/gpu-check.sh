#!/usr/bin/env bash
# One call on a GPU machine (the device tool): install the carried wheels, build
# lmd._native, run tests/gpu, and time the engine. Results land in $OUT (or ./gpu-out).
# Needs: scripts/../.whl from ../shared/scripts/device-wheels.sh (+ pytest pluggy
# iniconfig pytest-timeout pytest-asyncio prometheus-client packaging), carried as `.whl`.
#   scripts/gpu-check.sh [quick|full|migration]   quick: tests only; full: also the
#   Llama-3-8B shape; migration: the cuda_ipc tests, lmd-bench migration, and TTFT of a
#   ~2k-token prompt on a Llama-3-8B shape, hybrid vs disaggregated (carry .gpu-assets:
#   SmolLM2's tokenizer files, see tests/gpu/test_disaggregated_gpu.py)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# The import packages live in folders named otherwise (daemon/ is lmd).
mkdir -p /tmp/pkgs && ln -sfn "$PWD/daemon" /tmp/pkgs/lmd && ln -sfn "$PWD/clients" /tmp/pkgs/lmd_client
export PYTHONPATH=/tmp/pkgs:/tmp/site:$PWD
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee "$out/env.txt"
python3 setup.py -q build_ext --inplace 2>&1 | tail -5 | tee "$out/build.txt"
if [[ "${1:-}" == "migration" ]]; then
  exec scripts/gpu-migration.sh "$out"
fi
python3 -m pytest -q -ra -p no:cacheprovider tests/gpu tests/unit/test_native_host.py \
  2>&1 | tee "$out/gpu-tests.txt" | tail -25
[[ "${1:-}" == "quick" ]] && exit 0
# Engine throughput with random weights (bf16), the workload of ARCHITECTURE §8.
python3 - "${1:-}" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
shapes = {"smollm2-shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                                eos_token_id=2)}
if sys.argv[1] == "full":
    shapes["llama3-8b-shape"] = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                     num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, rope_theta=500000.0,
                                     bos_token_id=128000, eos_token_id=128001)
for name, fields in shapes.items():
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=8192, **fields))
    model.to(torch.bfloat16).save_pretrained(f"/tmp/{name}")
PY
bench() {
  python3 -m lmd.bench offline --device cuda --input-len 512 --output-len 256 --json "$@" \
    2>"$out/bench-stderr.txt" | tail -1 | tee -a "$out/offline.jsonl"
}
for batch in 1 64 256 512; do bench --model /tmp/smollm2-shape --batch "$batch"; done
bench --model /tmp/smollm2-shape --batch 64 --compare-hf
if [[ "${1:-}" == "full" ]]; then
  for batch in 1 64 512; do bench --model /tmp/llama3-8b-shape --batch "$batch"; done
  # The KV pool leaves room for transformers' own copy of the 16 GB of weights.
  bench --model /tmp/llama3-8b-shape --batch 64 --compare-hf --cache-max-entry-count 0.3
fi
