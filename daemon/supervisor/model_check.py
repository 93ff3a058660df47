"""The model, checked once in the supervisor before any worker is spawned.

Every worker loads the model itself (engine/model_source.py); a model they cannot load
would make each of them die at start, be restarted with backoff and, after
max_fast_failures, make the daemon give up: about 50 s of restarts for one bad path. So
lmdd checks it first and exits at once with the reason. The rules are resolve_model's,
without its expensive part: a GGUF is not converted here, only its header is read.
"""

from __future__ import annotations

from pathlib import Path

from lmd.config import ConfigError, ServeConfig
from lmd.engine.model_source import ModelSourceError, default_gguf_path, resolve_model
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
