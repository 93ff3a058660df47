"""Quantized weights and KV against 16-bit on real weights, or a CPU's bf16 GEMMs against
fp32: greedy agreement and the log-likelihood of a fixed text (docs/benchmarks.md,
"Quantization" and "CPU, eighth pass").

    python3 scripts/quant_quality.py MODEL [--settings bf16,w4a16,fp8,kv-int8,kv-fp8]
        [--tokens 32]
    python3 scripts/quant_quality.py [MODEL] --device cpu [--settings fp32,bf16-matmul]

Each setting is one in-process pipeline: on CUDA turbo with bfloat16 activations, against
the bf16 run; on a CPU (MODEL unset: the embedded SmolLM2) the torch backend in float32,
against the run whose GEMMs are all fp32 (`cpu_matmul_dtype`). 8 chat prompts, greedy,
`--tokens` new tokens each (ignore_eos), compared with the reference run's tokens (how
many of a prompt's tokens match before the first that differs; a run that matches to the
end counts all), and the mean log-likelihood per token of TEXT (get_ppl: the mean
cross-entropy, negated). One JSON line per setting.
"""

from __future__ import annotations

import argparse
import json

from lmd.pipeline import GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig, pipeline

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "How many legs does a spider have?",
    "Give me a short tip for learning to cook.",
    "What does a compiler do?",
    "Name a planet with rings and describe it briefly.",
]
TEXT = (
    "The river ran low that summer, and the children of the village walked along its bed "
    "looking for the stones their grandparents had talked about: flat grey stones with "
    "white bands, which were said to bring luck to whoever carried one through the winter. "
    "Most of them found nothing but mud and the shells of small snails, but the youngest, "
    "who was patient and did not mind getting her hands dirty, came home with three."
)
SETTINGS = {
    "bf16": {},
    "w4a16": {"quantization": "w4a16"},
    "fp8": {"quantization": "fp8"},
    "kv-int8": {"quant_policy": 8},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
}
CPU_SETTINGS = {
    "fp32": {"cpu_matmul_dtype": "float32"},
    "bf16-matmul": {"cpu_matmul_dtype": "bfloat16"},
}
REFERENCE = {"cuda": "bf16", "cpu": "fp32"}


def run(model: str | None, setting: str, tokens: int, device: str) -> tuple[list[list[int]], float]:
    config: PytorchEngineConfig | TurbomindEngineConfig
    if device == "cpu":
        config = PytorchEngineConfig(device_type="cpu", dtype="float32", **CPU_SETTINGS[setting])  # type: ignore[arg-type]
    else:
        options = SETTINGS[setting]
        config = TurbomindEngineConfig(device_type="cuda", dtype="bfloat16", **options)  # type: ignore[arg-type]
    with pipeline(model, backend_config=config) as pipe:
        gen = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
        outputs = pipe([[{"role": "user", "content": p}] for p in PROMPTS], gen_config=gen)
        ids = pipe.prompter.encode(TEXT)
        cross_entropy = pipe.get_ppl(ids)[0]
    return [o.token_ids for o in outputs], -cross_entropy


def agreement(reference: list[list[int]], got: list[list[int]]) -> list[int]:
    """Per prompt: how many leading tokens equal the reference's."""
    counts = []
    for ref, out in zip(reference, got, strict=True):
        n = 0
        while n < min(len(ref), len(out)) and ref[n] == out[n]:
            n += 1
        counts.append(n)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--device", choices=sorted(REFERENCE), default="cuda")
    parser.add_argument("--settings")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    ref = REFERENCE[args.device]
    settings = args.settings or ",".join(CPU_SETTINGS if args.device == "cpu" else SETTINGS)
    reference, ref_ll = run(args.model, ref, args.tokens, args.device)
    for setting in settings.split(","):
        ids, ll = (
            (reference, ref_ll)
            if setting == ref
            else run(args.model, setting, args.tokens, args.device)
        )
        same = agreement(reference, ids)
        print(json.dumps({"setting": setting, "tokens_before_divergence": same,
                          "prompts_identical": sum(n == args.tokens for n in same),
                          "mean_loglik_per_token": round(ll, 4),
                          "loglik_delta": round(ll - ref_ll, 4)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
