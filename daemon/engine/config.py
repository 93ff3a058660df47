"""Engine settings shared by the KV pool, block manager and schedulers.

The names and defaults follow LMDeploy's engine config, so that `--block-size`,
`--max-batch-size`, `--max-prefill-token-num`, `--session-len`,
`--cache-max-entry-count` and `--enable-prefix-caching` mean what its users expect.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A config.json that names no max_position_embeddings: the length Llama's config assumes
# and vLLM falls back to.
DEFAULT_CONTEXT_LEN = 2048
# Weights quantized at load (--quantization); a checkpoint's own quantization (AWQ, GPTQ,
# FP8) is read from its config.json and needs no flag.
QUANTIZATIONS = ("fp8", "w4a16")
# KV pool element types (--kv-cache-dtype): auto = the model's dtype; int8 and fp8 (e4m3)
# with a float16 scale per token and head (LMDeploy's quant_policy=8 is int8).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# The input type of a float32 model's GEMMs on a CPU (torch_backend/linear.py): auto =
# bfloat16 where the CPU has bf16 dot products, float32 elsewhere.
CPU_MATMUL_DTYPES = ("auto", "float32", "bfloat16")
MIXED_PREFILL_TOKENS = 256  # on a CPU, unless set: prompt tokens a decode step carries
# Most ranks a tensor-parallel group may have (one per GPU of a host; engine/parallel.py).
MAX_TP = 8


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """A model directory's config.json, as read."""
    config: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    return config


def architecture(model_dir: Path) -> str:
    """The model class config.json names (`architectures[0]`), or "unknown"."""
    archs = read_hf_config(model_dir).get("architectures") or ["unknown"]
    return str(archs[0])


def checkpoint_quant_method(model_dir: Path) -> str | None:
    """The quant_method of a checkpoint's quantization_config ("awq", "gptq", "fp8", ...),
    None when its config.json has none (or there is no config.json: a GGUF file)."""
    path = Path(model_dir) / "config.json"
    packed = read_hf_config(model_dir).get("quantization_config") if path.is_file() else None
    if not packed:
        return None
    method = packed.get("quant_method") if isinstance(packed, dict) else None
    return str(method or "unknown")


def text_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config.json (`text_config` of a multimodal one)."""
    return hf_config.get("text_config") or hf_config


def context_len(hf_config: Mapping[str, Any]) -> int:
    """A model's context length, from its config.json as read: max_position_embeddings
    (of `text_config` for a multimodal model), else DEFAULT_CONTEXT_LEN. The tokenizer
    and every backend read it here, so they agree on what fits."""
    return int(text_config(hf_config).get("max_position_embeddings") or DEFAULT_CONTEXT_LEN)


def resolve_session_len(session_len: int | None, model_context_len: int) -> int:
    """The cap on prompt + output tokens per sequence: `session_len` (--session-len),
    which may not exceed the model's context length (positions past it are not
    meaningful), or by default that context length."""
    _check_int("model_context_len", model_context_len, minimum=2)
    if session_len is None:
        return model_context_len
    if session_len > model_context_len:
        raise ValueError(
            f"session_len={session_len} exceeds the model's context length "
            f"{model_context_len}; lower --session-len"
        )
    return session_len


@dataclass(slots=True)
class EngineConfig:
    """How one engine process pages, batches and caches.

    cache_max_entry_count: a float in (0, 1] is the fraction of the memory left free
    after the weights that the KV pool takes; an int > 0 is an exact block count.
    session_len: cap on prompt + output tokens per sequence; None = the model's context
    length (resolve it with `with_session_len` once the model is loaded).
    overlap_steps: launch each decode step before reading back the previous one's tokens,
    so the host prepares step N+1 while the device runs step N (engine.py); None = where
    the model runs on CUDA (on a CPU there is no device to overlap with).
    mixed_prefill_tokens: while prompts wait, a hybrid engine's decode steps carry this
    many prompt tokens in their forward (more when many wait; engine.py); 0 = prefill
    steps of their own, which stall every decoding sequence; None = MIXED_PREFILL_TOKENS
    on a CPU, 0 on CUDA (there the mixed forward leaves the decode step's CUDA graph and
    measured slower than it saves: docs/benchmarks.md, "Mixed steps").
    quantization: weights quantized at load (QUANTIZATIONS), None = as the checkpoint is.
    kv_cache_dtype: the KV pool's element type (KV_CACHE_DTYPES).
    cpu_matmul_dtype: the input type of a float32 model's GEMMs on a CPU: of more than 16
    rows (prompts, large decode batches), and at decode those of weights held as a GGUF's
    codes (CPU_MATMUL_DTYPES; the torch backend, torch_backend/linear.py).
    """

    block_size: int = 64
    max_batch_size: int = 128
    max_prefill_token_num: int = 8192
    session_len: int | None = None
    cache_max_entry_count: float | int = 0.8
    enable_prefix_caching: bool = False
    overlap_steps: bool | None = None
    mixed_prefill_tokens: int | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    cpu_matmul_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, minimum=1)
        _check_int("max_batch_size", self.max_batch_size, minimum=1)
        _check_int("max_prefill_token_num", self.max_prefill_token_num, minimum=1)
        if self.session_len is not None:
            _check_int("session_len", self.session_len, minimum=2)
        _check_cache_max_entry_count(self.cache_max_entry_count)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}"
            )
        if self.overlap_steps is not None and not isinstance(self.overlap_steps, bool):
            raise ValueError(
                f"overlap_steps must be true, false or None, got {self.overlap_steps!r}"
            )
        if self.mixed_prefill_tokens is not None:
            _check_int("mixed_prefill_tokens", self.mixed_prefill_tokens, minimum=0)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} or unset, "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.cpu_matmul_dtype not in CPU_MATMUL_DTYPES:
            raise ValueError(
                f"cpu_matmul_dtype must be one of {', '.join(CPU_MATMUL_DTYPES)}, "
                f"got {self.cpu_matmul_dtype!r}"
            )

    @property
    def quantized(self) -> str | None:
        """What of these settings needs quantized kernels, as flags name it; None = nothing."""
        asked = [f"--quantization {self.quantization}"] if self.quantization else []
        if self.kv_cache_dtype != "auto":
            asked.append(f"--kv-cache-dtype {self.kv_cache_dtype}")
        return " and ".join(asked) or None

    @property
    def cache_is_block_count(self) -> bool:
        """True when cache_max_entry_count names a block count rather than a fraction."""
        return isinstance(self.cache_max_entry_count, int)

    def with_session_len(self, model_context_len: int) -> EngineConfig:
        """A copy whose session_len is resolved (resolve_session_len)."""
        session_len = resolve_session_len(self.session_len, model_context_len)
        return dataclasses.replace(self, session_len=session_len)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_cache_max_entry_count(value: object) -> None:
    if isinstance(value, bool):
        raise ValueError(
            "cache_max_entry_count must be a fraction in (0, 1] or a block count > 0, "
            f"got {value!r}"
        )
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"cache_max_entry_count as a block count must be > 0, got {value}")
        return
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(
                f"cache_max_entry_count as a fraction must be in (0, 1], got {value}; "
                "pass an integer for a block count"
            )
        return
    raise ValueError(
        f"cache_max_entry_count must be a float fraction or an int block count, got {value!r}"
    )
