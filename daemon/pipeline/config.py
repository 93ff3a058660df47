"""The pipeline's settings, under LMDeploy's names and defaults.

`GenerationConfig` is per request (how to sample, when to stop, what to return);
`PytorchEngineConfig` and `TurbomindEngineConfig` are the engine's, mapped onto lmd's
EngineConfig and backends: PytorchEngineConfig runs the `torch` backend (CPU or CUDA),
TurbomindEngineConfig asks for `turbo` where it can run and falls back to `torch` with a
warning otherwise (LMDeploy's own fallback from TurboMind to its PyTorch engine).
`ChatTemplateConfig` is LMDeploy's template fields (lmd's LmdeployChatTemplate); its
built-in templates by `model_name` are not bundled, so every field needed is written out.
Nothing here does I/O: the pipeline checks the device when it builds the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from lmd.engine.config import MAX_TP, EngineConfig
from lmd.engine.sequence import SamplingParams
from lmd.tokenizer.text.chat_template import LmdeployChatTemplate

ChatTemplateConfig = LmdeployChatTemplate
OUTPUT_MODES = ("all", "generation")  # output_logits / output_last_hidden_state
# LMDeploy's quant_policy -> the KV cache dtype (its 4, int4 KV, lmd does not have).
KV_POLICIES = {0: "auto", 8: "int8"}


@dataclass(slots=True, kw_only=True)
class GenerationConfig:
    """How to generate for one prompt (LMDeploy's GenerationConfig, the fields lmd runs).

    do_sample False (the default) is greedy whatever the temperature. max_new_tokens None
    generates until EOS or the session length. stop_words end the text (not part of it);
    stop_token_ids end generation on those ids. logprobs N (0..20) returns, per output
    token, the chosen token's logprob and the N most likely. output_logits and
    output_last_hidden_state ("generation" or "all") return float32 tensors on the CPU:
    one row per generated token, or per prompt token and generated token but the last.
    """

    n: int = 1
    max_new_tokens: int | None = 512
    do_sample: bool = False
    top_p: float = 1.0
    top_k: int = 50
    min_p: float = 0.0
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    skip_special_tokens: bool = True
    logprobs: int | None = None
    output_logits: str | None = None
    output_last_hidden_state: str | None = None

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n must be 1 (one output per prompt), got {self.n!r}")
        if self.max_new_tokens is not None:
            _int("max_new_tokens", self.max_new_tokens, minimum=1)
        if self.random_seed is not None:
            _int("random_seed", self.random_seed, minimum=None)
        for name in ("do_sample", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        words: object = self.stop_words
        if words is not None and (
            not isinstance(words, list | tuple) or not all(isinstance(w, str) for w in words)
        ):
            raise ValueError(f"stop_words must be a list of strings, got {words!r}")
        for name in ("output_logits", "output_last_hidden_state"):
            if getattr(self, name) not in (None, *OUTPUT_MODES):
                raise ValueError(
                    f"{name} must be None, 'generation' or 'all', got {getattr(self, name)!r}"
                )
        self._sampling(self.temperature, max_tokens=1)  # the engine's checks, raised here

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams, generating at most `max_tokens` (the caller's
        min(max_new_tokens, what the session length leaves))."""
        return self._sampling(self.temperature if self.do_sample else 0.0, max_tokens)

    def _sampling(self, temperature: float, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.random_seed,
            max_tokens=max_tokens,
            min_new_tokens=self.min_new_tokens or 0,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
        )

    @property
    def wants_tensors(self) -> bool:
        return self.output_logits is not None or self.output_last_hidden_state is not None


@dataclass(slots=True, kw_only=True)
class _EngineSettings(ABC):
    """What both engine configs share. device_type None: CUDA where available, else CPU."""

    dtype: str = "auto"  # auto = bf16 on CUDA (fp16 where bf16 is unsupported), fp32 on CPU
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = None
    cache_max_entry_count: float | int = 0.8
    enable_prefix_caching: bool = False
    device_type: str | None = None
    quant_policy: int = 0  # LMDeploy's KV cache quantization: 0 none, 8 int8
    kv_cache_dtype: str | None = None  # lmd's name for it (auto, int8, fp8); wins if set
    quantization: str | None = None  # lmd's: weights quantized at load, fp8 or w4a16
    cpu_matmul_dtype: str = "auto"  # lmd's: a float32 model's large CPU GEMMs (EngineConfig)

    backend: ClassVar[str]
    DEFAULT_MAX_BATCH_SIZE: ClassVar[int] = 128

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or not 1 <= self.tp <= MAX_TP:
            raise ValueError(f"tp must be an integer from 1 to {MAX_TP}, got {self.tp!r}")
        device = self.device_type
        if device is not None and (
            not isinstance(device, str) or device.split(":")[0] not in ("cuda", "cpu")
        ):
            raise ValueError(f"device_type must be 'cuda', 'cuda:N', 'cpu' or None, got {device!r}")
        if self.quant_policy not in KV_POLICIES:
            raise ValueError(
                f"quant_policy must be 0 (no KV quantization) or 8 (int8 KV), got "
                f"{self.quant_policy!r}; lmd has no 4-bit KV cache"
            )
        self.engine_config()  # EngineConfig's checks, raised here

    @abstractmethod
    def sizes(self) -> tuple[int, int]:
        """(tokens per KV block, tokens per prefill step), named differently by each."""

    def engine_config(self) -> EngineConfig:
        block_size, max_prefill_token_num = self.sizes()
        return EngineConfig(
            block_size=block_size,
            max_batch_size=(
                self.DEFAULT_MAX_BATCH_SIZE if self.max_batch_size is None else self.max_batch_size
            ),
            max_prefill_token_num=max_prefill_token_num,
            session_len=self.session_len,
            cache_max_entry_count=self.cache_max_entry_count,
            enable_prefix_caching=self.enable_prefix_caching,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype or KV_POLICIES[self.quant_policy],
            cpu_matmul_dtype=self.cpu_matmul_dtype,
        )


@dataclass(slots=True, kw_only=True)
class PytorchEngineConfig(_EngineSettings):
    """LMDeploy's PytorchEngineConfig: lmd's `torch` backend, on CPU or CUDA."""

    block_size: int = 64
    max_prefill_token_num: int = 4096

    backend: ClassVar[str] = "torch"

    def sizes(self) -> tuple[int, int]:
        return self.block_size, self.max_prefill_token_num


@dataclass(slots=True, kw_only=True)
class TurbomindEngineConfig(_EngineSettings):
    """LMDeploy's TurbomindEngineConfig: lmd's `turbo` backend where it can run (Llama,
    Mistral, Qwen2 on CUDA), else `torch` with a warning that says why."""

    cache_block_seq_len: int = 64
    max_prefill_token_num: int = 8192

    backend: ClassVar[str] = "auto"

    def sizes(self) -> tuple[int, int]:
        return self.cache_block_seq_len, self.max_prefill_token_num


EngineSettings = PytorchEngineConfig | TurbomindEngineConfig


def _int(name: str, value: object, *, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
