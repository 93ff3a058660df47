"""Random-weight bf16 models of the benchmark shapes (docs/benchmarks.md), for GPU scripts.

    python3 scripts/random_models.py smollm2-shape [llama3-8b-shape qwen3-8b-shape
        qwen3-30b-a3b-shape ...] [--vocab N] [--layers N] [--tokenizer DIR]
        [--out-dir /tmp] [--streamed] [--device cuda]

Each lands in OUT_DIR/NAME (with --layers N: NAME-Nl). `--vocab` cuts the vocabulary (to
match a carried tokenizer, whose files `--tokenizer` copies in); `--layers` keeps the
first N layers (a shape's per-layer kernels timed without writing all of it). Weights
are drawn in bf16 on the GPU (a 30B model never exists in float32), Qwen3's vocabulary
(151,936) pairs with the tokenizer in ../shared/assets/tokenizers/qwen3. A model larger
than one GPU (the 70B shape, 141 GB; `--streamed` for any) is never built whole: its
tensors' names and shapes come from the model class on the meta device, each is drawn
alone and written into safetensors shards of about 4 GB, with transformers' index file.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}
QWEN3 = {"vocab_size": 151936, "head_dim": 128, "rope_theta": 1000000.0,
         "bos_token_id": 151643, "eos_token_id": 151645}  # fmt: skip
SHAPES = {
    "smollm2-shape": {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "llama3-8b-shape": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "qwen3-8b-shape": {
        "family": "qwen3",
        **QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    # ~61 GB of bf16 weights: one H200.
    "qwen3-30b-a3b-shape": {
        "family": "qwen3-moe",
        **QWEN3,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
    },
    # Llama-3-70B: ~141 GB of bf16 weights, two H200s (tensor parallelism, issue 23).
    "llama3-70b-shape": {
        "streamed": True,
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # Gemma 3 12B's text model, with Qwen3's vocabulary (its tokenizer is the one we
    # carry; Gemma's 262,208 would add 0.4B parameters of embedding).
    "gemma3-12b-shape": {
        "family": "gemma3",
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    },
}


SHARD_BYTES = 4 << 30


def write_streamed(
    config: PretrainedConfig, model_class: type[PreTrainedModel], path: Path, device: str
) -> None:
    """The model's random weights written tensor by tensor (see the module doc): normal
    with the config's initializer_range for matrices, ones for norms, zeros for biases."""
    with torch.device("meta"):
        model = model_class(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    std = float(getattr(config, "initializer_range", 0.02))
    path.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    files: list[list[str]] = []
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            files.append(list(shard))
            save_file(
                {k: v.contiguous() for k, v in shard.items()}, str(path / f"part-{len(files)}")
            )
        shard, size = {}, 0

    for name, param in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        if param.ndim >= 2:
            tensor = torch.randn(param.shape, device=device, dtype=torch.bfloat16) * std
        elif name.endswith("bias"):
            tensor = torch.zeros(param.shape, device=device, dtype=torch.bfloat16)
        else:
            tensor = torch.ones(param.shape, device=device, dtype=torch.bfloat16)
        shard[name] = tensor.cpu()
        size += tensor.nbytes
        if size >= SHARD_BYTES:
            flush()
    flush()
    total = len(files)
    for i, names in enumerate(files, 1):
        final = f"model-{i:05d}-of-{total:05d}.safetensors"
        (path / f"part-{i}").rename(path / final)
        index.update(dict.fromkeys(names, final))
    weight_map = {"metadata": {}, "weight_map": index}
    config.architectures = [model_class.__name__]  # save_pretrained of a model sets it
    (path / "model.safetensors.index.json").write_text(json.dumps(weight_map, indent=1))
    config.save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--streamed", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    for name in args.names:
        fields = dict(SHAPES[name])
        streamed = bool(fields.pop("streamed", False)) or args.streamed
        config_class, model_class = CLASSES.get(
            str(fields.pop("family", "")), (LlamaConfig, LlamaForCausalLM)
        )
        if args.vocab:
            fields.update(vocab_size=args.vocab, bos_token_id=1, eos_token_id=2)
        path = args.out_dir / name
        if args.layers:
            fields["num_hidden_layers"] = args.layers
            path = args.out_dir / f"{name}-{args.layers}l"
        config = config_class(max_position_embeddings=8192, **fields)
        if streamed:
            write_streamed(config, model_class, path, args.device)
        else:
            with torch.device(args.device):
                model = model_class(config)
            model.save_pretrained(path)
            del model
        if args.tokenizer is not None:  # its files, but not a model's (config.json)
            for f in args.tokenizer.iterdir():
                if f.name not in ("config.json", "generation_config.json"):
                    shutil.copy(f, path / f.name)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
