"""Models for tests: a tiny random-weight Llama from a fixed seed, and HF references."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel

TINY_VOCAB = 512
TINY_EOS = 1
# The tiny test models' widths: 2 layers, hidden 64, 4 heads over 2 KV heads, vocab 512.
TINY_SHAPE: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


# The tiny Llama of the GPU tests: wider than TINY_SHAPE, peakier logits than the default
# initializer (fewer near-ties between greedy candidates).
GPU_LLAMA: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "initializer_range": 0.05,
}


def save_tiny_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """2 layers, hidden 64, 4 heads over 2 KV heads (GQA), vocab 512, random weights from
    `seed`; `overrides` change LlamaConfig fields. Saved as safetensors."""
    torch.manual_seed(seed)
    fields: dict[str, Any] = {
        **TINY_SHAPE,
        "max_position_embeddings": 1024,
        "bos_token_id": 0,
        "eos_token_id": TINY_EOS,
    }
    config = LlamaConfig(**{**fields, **overrides})
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def load_reference(path: Path) -> PreTrainedModel:
    """The transformers model itself, in float32, for hf_greedy."""
    model: PreTrainedModel = LlamaForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    )
    model.train(False)
    return model


def hf_greedy(model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding of exactly max_new_tokens, as with ignore_eos.

    EOS must neither stop nor be masked (transformers' min_new_tokens would mask it), and
    generate() fills a GenerationConfig's unset fields from the model's own, so the EOS
    id is cleared on the model itself. The explicit attention mask matters: without it
    generate masks every prompt token equal to the pad id (SmolLM2 pads with
    <|im_end|>, which its chat template puts in every prompt).
    """
    model.generation_config.eos_token_id = None
    # GenerationConfig takes **kwargs, untyped in transformers.
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    with torch.inference_mode():
        ids = torch.tensor([list(prompt)], device=model.device)
        out = model.generate(  # type: ignore[operator]  # generate is untyped in transformers
            ids, attention_mask=torch.ones_like(ids), generation_config=config
        )
    return [int(t) for t in out[0, len(prompt) :]]


def random_prompts(
    lengths: Sequence[int], vocab: int = TINY_VOCAB, seed: int = 1
) -> list[list[int]]:
    """Random token ids, skipping 0 and 1 (bos and eos of the tiny Llama)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a name for a grey cat.",
    "What does a compiler do?",
]


def chat_prompts(model_dir: Path, questions: Sequence[str] = QUESTIONS) -> list[list[int]]:
    """Each question as one user turn through the model's own chat template, as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompts = []
    for q in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
        prompts.append(cast(list[int], ids))
    return prompts
