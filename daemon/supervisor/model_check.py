"""The model, checked once in the supervisor before any worker is spawned.

Every worker loads the model itself (engine/model_source.py); a model they cannot load
would make each of them die at start, be restarted with backoff and, after
max_fast_failures, make the daemon give up: about 50 s of restarts for one bad path. So
lmdd checks it first and exits at once with the reason. The rules are resolve_model's,
without its expensive part: a GGUF is not converted here, only its header is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmd.config import ConfigError, ServeConfig
from lmd.engine.config import MAX_TP, read_hf_config, text_config
from lmd.engine.model_source import ModelSourceError, default_gguf_path, resolve_model
from lmd.gpu_sharing import check_gpu_sharing
from lmd.protocol.roles import Role
from lmd.roles import role_counts

GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file
# Every role but the api loads the model (its tokenizer, or its weights).
LOADS_MODEL = frozenset({Role.TOKENIZER, Role.HYBRID, Role.PREFILL, Role.DECODE})


def check_daemon_model(config: ServeConfig) -> None:
    """check_model, when a worker this daemon runs loads it (a cluster node of `--roles
    api` runs none that does)."""
    if LOADS_MODEL.intersection(role_counts(config)):
        check_model(config.model)


def check_model(model: str | None) -> None:
    """Raise ModelSourceError (one line naming the path) unless the workers can load it."""
    if model is None:
        default_gguf_path()  # the embedded default: is it installed?
        return
    path = Path(model).expanduser().absolute()
    if path.is_file() and path.suffix.lower() == ".gguf":
        check_gguf_header(path)
        return
    # Anything else resolve_model checks without converting: a Hugging Face directory
    # (config.json + *.safetensors) passes, a missing path or another file is refused.
    resolve_model(path)


def check_gguf_header(path: Path) -> None:
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelSourceError(f"model {path} cannot be read: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelSourceError(
            f"model {path} is not a GGUF file (it does not start with {GGUF_MAGIC.decode()!r}): "
            "give a .gguf model file or a Hugging Face model directory"
        )


def check_engines(config: ServeConfig, device: str) -> None:
    """ConfigError for what the engines could not run (check_quantization,
    check_tensor_parallel, check_gpu_sharing): each would fail at start, be restarted
    and fail again."""
    check_quantization(config, device)
    check_tensor_parallel(config)
    check_gpu_sharing(config, device)


def check_quantization(config: ServeConfig, device: str) -> None:
    """ConfigError (one line) when quantized weights or KV are asked of engines that
    cannot run them: backend turbo on CUDA only (engine/backends.py). Each such engine
    would fail at start and be restarted until the daemon gave up. `device` is the
    daemon's, auto resolved."""
    asked = config.engine.quantized
    if asked is None:
        return
    for role in sorted(LOADS_MODEL.intersection(role_counts(config)) - {Role.TOKENIZER}):
        backend = config.prefill_backend if role == Role.PREFILL else config.decode_backend
        where = config.role_device(role, device)
        if where == "cpu" or backend in ("torch", "fake"):
            key = "quantization" if config.quantization else "kv_cache_dtype"
            raise ConfigError(
                f"{key}: {asked} runs on backend turbo on CUDA only, and the {role} "
                f"engines would run backend {backend} on {where}"
            )


def check_tensor_parallel(config: ServeConfig) -> None:
    """ConfigError (one line) when an engine role's tensor-parallel size does not divide
    the model's attention heads and KV heads: each rank holds whole heads
    (engine/parallel.py), so every rank would refuse its shard at start."""
    sizes = {
        (role, config.tp_of(role))
        for role in LOADS_MODEL.intersection(role_counts(config)) - {Role.TOKENIZER}
    }
    sizes = {(role, size) for role, size in sizes if size > 1}
    if not sizes:
        return
    heads, kv_heads = model_heads(config.model)
    for role, size in sorted(sizes):
        if heads % size or kv_heads % size:
            fits = [n for n in range(2, MAX_TP + 1) if heads % n == 0 and kv_heads % n == 0]
            key = "tp" if role == Role.HYBRID or config.tp_of(role) == config.tp else f"{role}_tp"
            hint = f"use {' or '.join(map(str, fits))}" if fits else "it runs on one process only"
            raise ConfigError(
                f"{key}: {size} ranks cannot split the model's {heads} attention heads and "
                f"{kv_heads} KV heads (each rank holds whole heads); {hint}"
            )


def model_heads(model: str | None) -> tuple[int, int]:
    """(attention heads, KV heads) of a model directory's config.json, or of a GGUF's
    header (the embedded default when `model` is None)."""
    path = default_gguf_path() if model is None else Path(model).expanduser().absolute()
    if path.is_file():
        import gguf

        reader = gguf.GGUFReader(str(path))

        def value(key: str) -> Any:
            field = reader.fields[key]
            return field.parts[field.data[0]]

        arch = bytes(value("general.architecture")).decode()
        heads = int(value(f"{arch}.attention.head_count")[0])
        kv_key = f"{arch}.attention.head_count_kv"
        return heads, int(value(kv_key)[0]) if kv_key in reader.fields else heads
    raw = text_config(read_hf_config(path))
    heads = int(raw["num_attention_heads"])
    return heads, int(raw.get("num_key_value_heads") or heads)
