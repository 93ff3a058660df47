#!/usr/bin/env bash
# Served against offline on the CPU (issue 24, item 4), in one run: the embedded SmolLM2
# through `lmd-bench offline --compare-hf` (lmd's engine and transformers' generate at
# batch 8, 128 in / 64 out), then `lmdd serve --mode MODE` and `lmd-bench serve` at
# concurrency 8 (chat, 128 words in / 64 tokens out, ignore_eos, a fresh seed so that the
# prefix cache holds none of the prompts).
#   scripts/cpu-served.sh [MODE [REQUESTS [OUT_DIR]]]   (default: disaggregated 32 .)
# LMDD_FLAGS (words): more flags for lmdd serve (e.g. "--mixed-prefill-tokens 0").
# Needs the README's install (.venv). Prints both summaries; OUT_DIR gets the JSON.
set -euo pipefail
mode=${1:-disaggregated} n=${2:-32} dir=${3:-.}
bin=.venv/bin
mkdir -p "$dir"
"$bin/lmd-bench" offline --batch 8 --input-len 128 --output-len 64 --compare-hf \
  --out "$dir/offline-b8.json"
port=$("$bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
rt=$(mktemp -d)
"$bin/lmdd" serve --mode "$mode" --port "$port" --runtime-dir "$rt" ${LMDD_FLAGS:-} >"$rt/daemon.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$rt"' EXIT
for _ in $(seq 600); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 0.5; done
"$bin/lmd-bench" serve --url "http://127.0.0.1:$port" --endpoint /v1/chat/completions \
  --num-prompts "$n" --concurrency 8 --input-len 128 --output-len 64 --ignore-eos \
  --seed "$RANDOM" --warmup 2 --no-progress --label "served-c8-$mode" \
  --out "$dir/served-c8-$mode.json"
