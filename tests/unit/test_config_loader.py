"""Config precedence (command line > LMD_* env > TOML file > defaults), errors, reload."""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from lmd.cli import _parser, config_source
from lmd.config import ConfigError, ServeConfig
from lmd.config_loader import (
    COMMAND_LINE,
    DEFAULT,
    KEYS,
    ConfigSource,
    default_values,
    flatten,
    plan_reload,
    reload_config,
)

NO_DEFAULT_FILE = Path("/nonexistent/lmd.toml")
EXAMPLE = Path(__file__).parents[2] / "systemd" / "lmd.toml"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def source(tmp_path: Path, toml: str | None = None, **cli: object) -> ConfigSource:
    path = write(tmp_path / "lmd.toml", toml) if toml is not None else None
    return ConfigSource(cli=cli, path=path, default_path=NO_DEFAULT_FILE)


def test_defaults_without_file_env_or_flags(tmp_path: Path) -> None:
    loaded = source(tmp_path, runtime_dir=str(tmp_path)).load(env={})
    c = loaded.config
    assert (c.host, c.port, c.log_level, c.restart.max_fast_failures) == (
        "127.0.0.1",
        23333,
        "info",
        5,
    )
    assert loaded.file is None
    assert loaded.origins["port"] == DEFAULT and loaded.origins["runtime_dir"] == COMMAND_LINE


def test_command_line_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    toml = 'port = 1000\nhost = "0.0.0.0"\nlog_level = "debug"\nrestart_backoff = 2\n'
    env = {"LMD_PORT": "2000", "LMD_LOG_LEVEL": "warning", "LMD_SOCKET": "/not/a/key"}
    loaded = source(tmp_path, toml, port=3000).load(env)
    c = loaded.config
    assert c.port == 3000  # flag over env over file
    assert c.log_level == "warning"  # env over file
    assert c.host == "0.0.0.0" and c.restart.backoff_s == 2.0  # file over default
    assert c.drain_timeout == 30.0  # default
    file = f"file {tmp_path / 'lmd.toml'}"
    assert loaded.origins["port"] == COMMAND_LINE
    assert loaded.origins["log_level"] == "env LMD_LOG_LEVEL"
    assert loaded.origins["host"] == file and loaded.origins["restart_backoff"] == file
    assert loaded.origins["drain_timeout"] == DEFAULT


def test_the_default_file_is_read_only_when_it_exists(tmp_path: Path) -> None:
    default = write(tmp_path / "default.toml", "port = 4444\n")
    assert ConfigSource(default_path=default).load(env={}).config.port == 4444
    missing = ConfigSource(default_path=tmp_path / "missing.toml").load(env={})
    assert missing.config.port == 23333 and missing.file is None


def test_a_named_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file .*nope\.toml does not exist"):
        ConfigSource(path=tmp_path / "nope.toml").load(env={})


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("prot = 80\n", r"unknown key 'prot' \(did you mean 'port'\?\)"),
        ("[server]\nport = 80\n", r"unknown key 'server'"),
        ('port = "80"\n', r"port: expected an integer, got a string \('80'\)"),
        ("port = 80.0\n", r"port: expected an integer, got a float"),
        ('api_keys = "k1"\n', r"api_keys: expected an array of strings, got a string"),
        ("api_keys = [1]\n", r"api_keys: expected an array of strings, got an array"),
        ('enable_prefix_caching = "yes"\n', r"enable_prefix_caching: expected a boolean"),
        ("cache_max_entry_count = 2.5\n", r"cache_max_entry_count as a fraction must be in"),
        ("block_size = 0\n", r"block_size must be an integer >= 1"),
        ("prefill_workers = true\n", r"prefill_workers: expected an integer, got a boolean"),
        ("drain_timeout = nan\n", r"drain_timeout: nan is not a finite number"),
        ("log_level = 3\n", r"log_level: expected a string, got an integer"),
        ('host = ""\n', r"host: must not be empty"),
        ("port = 70000\n", r"port: 70000 is not a TCP port"),
        ('log_level = "loud"\n', r"log_level: 'loud' is not one of"),
        ("max_fast_failures = 0\n", r"max_fast_failures: must be >= 1"),
        ("port = \n", r"not valid TOML"),
        # JSON (orjson: workers, the control API) carries no integer past int64
        ("max_request_bytes = 99999999999999999999\n", r"max_request_bytes: 9+ is out of range"),
        ("session_len = -99999999999999999999\n", r"session_len: -9+ is out of range"),
        ("drain_timeout = 99999999999999999999\n", r"drain_timeout: 9+ is out of range"),
        ("restart_backoff = 60\n", r"restart_backoff: must be at most 30 seconds"),
        ('chat_template = "~nosuchuser/t.json"\n', r"chat_template: cannot expand '~nosuch"),
    ],
)
def test_file_errors_name_the_file_and_the_key(tmp_path: Path, toml: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        source(tmp_path, toml, runtime_dir=str(tmp_path)).load(env={})
    text = str(err.value)
    assert text.startswith(f"{tmp_path / 'lmd.toml'}: ") and "\n" not in text
    assert re.search(message, text), text


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LMD_PORT": "eighty"}, r"^LMD_PORT: port: 'eighty' is not an integer$"),
        ({"LMD_DRAIN_TIMEOUT": "inf"}, r"^LMD_DRAIN_TIMEOUT: drain_timeout: 'inf' is not a"),
        ({"LMD_DEVICE": "tpu"}, r"^LMD_DEVICE: device: 'tpu' is not auto, cpu"),
        ({"LMD_ENABLE_PREFIX_CACHING": "maybe"}, r"^LMD_ENABLE_PREFIX_CACHING: .*not a boolean"),
        ({"LMD_SESSION_LEN": "1"}, r"^LMD_SESSION_LEN: session_len must be an integer >= 2"),
        ({"LMD_MAX_BATCH_SIZE": "9" * 20}, r"^LMD_MAX_BATCH_SIZE: max_batch_size: 9+ is out of"),
        ({"LMD_MODEL": "~nosuchuser/m"}, r"^LMD_MODEL: model: cannot expand '~nosuchuser/m'"),
    ],
)
def test_env_errors_name_the_variable(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        source(tmp_path, runtime_dir=str(tmp_path)).load(env)


def test_every_kind_from_file_env_and_flags(tmp_path: Path) -> None:
    toml = (
        'api_keys = ["k1", "k2"]\nenable_prefix_caching = true\ncache_max_entry_count = 0.5\n'
        "drain_timeout = 10\n"
    )
    c = source(tmp_path, toml, runtime_dir=str(tmp_path)).load(env={}).config
    assert c.api_keys == ("k1", "k2") and c.enable_prefix_caching is True
    assert c.cache_max_entry_count == 0.5 and c.drain_timeout == 10.0
    env = {
        "LMD_API_KEYS": "a, b,",
        "LMD_ENABLE_PREFIX_CACHING": "off",
        "LMD_CACHE_MAX_ENTRY_COUNT": "1000",  # an integer is a block count, kept an int
        "LMD_SESSION_LEN": "4096",
    }
    c = source(tmp_path, toml, runtime_dir=str(tmp_path)).load(env).config
    assert c.api_keys == ("a", "b") and c.enable_prefix_caching is False
    assert c.cache_max_entry_count == 1000 and isinstance(c.cache_max_entry_count, int)
    assert c.session_len == 4096
    argv = ["serve", "--enable-prefix-caching", "--cache-max-entry-count", "0.25"]
    argv += ["--api-keys", "x,y", "--runtime-dir", str(tmp_path)]
    c = config_source(_parser().parse_args(argv)).load(env).config
    assert (c.enable_prefix_caching, c.cache_max_entry_count, c.api_keys) == (
        True,
        0.25,
        ("x", "y"),
    )


def test_bad_flag_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["serve", "--port", "eighty"])
    assert exit_.value.code == 2
    assert "argument --port: 'eighty' is not an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--max-request-bytes", "9" * 20])
    assert "does not fit in a 64-bit integer" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "lmd.toml"
    path.write_bytes(b'model_name = "caf\xe9"\n')  # Latin-1
    with pytest.raises(ConfigError) as err:
        ConfigSource(path=path, default_path=NO_DEFAULT_FILE).load(env={})
    assert str(err.value) == (
        f"{path}: not UTF-8 text (byte 0xe9 at offset 17): TOML files are UTF-8, save it as UTF-8"
    )


def test_api_keys_are_never_shown(tmp_path: Path) -> None:
    cfg = write(tmp_path / "lmd.toml", 'api_keys = ["secret-1"]\n')
    running = ConfigSource(cli={"runtime_dir": str(tmp_path)}, path=cfg).load(env={})
    assert running.to_json()["values"]["api_keys"] == ["<redacted>"]
    write(cfg, 'api_keys = ["secret-1", "secret-2"]\n')
    reloaded, plan = reload_config(running)
    shown = str(plan.to_json()) + str(reloaded.to_json())
    assert "secret" not in shown
    assert plan.applied == ["api_keys"]  # live: the api takes new keys without a restart


def test_an_empty_env_variable_counts_as_unset(tmp_path: Path) -> None:
    loaded = source(tmp_path, "port = 1000\n").load({"LMD_PORT": ""})
    assert loaded.config.port == 1000


def test_paths_in_the_file_are_relative_to_it(tmp_path: Path) -> None:
    (tmp_path / "models" / "m").mkdir(parents=True)
    toml = 'model = "models/m"\nruntime_dir = "run"\n'
    c = source(tmp_path, toml).load(env={}).config
    assert c.model == str(tmp_path / "models" / "m")
    assert c.runtime_dir == tmp_path / "run"


def test_a_missing_model_names_where_it_was_set(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"lmd\.toml: model: .*gone does not exist"):
        source(tmp_path, 'model = "/gone"\n').load(env={})
    with pytest.raises(ConfigError, match=r"^LMD_MODEL: model: /gone does not exist"):
        source(tmp_path).load({"LMD_MODEL": "/gone"})


def test_runtime_dir_falls_back_to_systemd_runtime_directory(tmp_path: Path) -> None:
    loaded = source(tmp_path).load({"RUNTIME_DIRECTORY": "/run/lmd"})
    assert loaded.config.runtime_dir == Path("/run/lmd")
    assert source(tmp_path).load({"LMD_RUNTIME_DIR": "/srv/rt"}).config.runtime_dir == Path(
        "/srv/rt"
    )


def test_every_key_has_a_flag_and_flags_left_out_stay_unset(tmp_path: Path) -> None:
    serve = next(
        a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices["serve"]
    dests = {a.dest for a in serve._actions} - {"help", "config"}
    assert dests == set(KEYS)
    args = _parser().parse_args(["serve", "--port", "9000", "--config", "/etc/x.toml"])
    src = config_source(args)
    assert dict(src.cli) == {"port": 9000} and src.path == Path("/etc/x.toml")


def test_cli_config_flag_reads_the_file_and_flags_override_it(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", 'port = 7000\nmodel_name = "prod"\ndecode_workers = 2\n')
    argv = ["serve", "--config", str(cfg), "--port", "7001", "--runtime-dir", str(tmp_path)]
    loaded = config_source(_parser().parse_args(argv)).load(env={})
    assert loaded.config.port == 7001
    assert (loaded.config.served_model_name, loaded.config.decode_workers) == ("prod", 2)


def test_reload_applies_live_keys_and_lists_the_rest(tmp_path: Path) -> None:
    cfg = write(tmp_path / "lmd.toml", 'log_level = "info"\nport = 1000\n')
    running = ConfigSource(cli={"runtime_dir": str(tmp_path)}, path=cfg).load(env={})
    write(cfg, 'log_level = "debug"\nport = 2000\ndecode_workers = 3\n')
    reloaded, plan = reload_config(running)
    assert plan.applied == ["log_level"]
    assert plan.needs_restart == ["port", "decode_workers"]
    assert plan.to_json()["changes"]["port"] == {"from": 1000, "to": 2000}
    # The live key changes; the others keep running with their old values until a restart.
    assert reloaded.config.log_level == "debug"
    assert (reloaded.config.port, reloaded.config.decode_workers) == (1000, 1)
    assert reloaded.needs_restart == {"port": 2000, "decode_workers": 3}
    assert reloaded.to_json()["values"]["port"] == 1000


def test_reload_of_a_bad_file_raises_and_changes_nothing(tmp_path: Path) -> None:
    cfg = write(tmp_path / "lmd.toml", "port = 1000\n")
    running = ConfigSource(cli={"runtime_dir": str(tmp_path)}, path=cfg).load(env={})
    write(cfg, "port = 'x'\n")
    with pytest.raises(ConfigError, match="port: expected an integer"):
        reload_config(running)
    assert running.config.port == 1000


def test_flatten_uses_the_file_keys(tmp_path: Path) -> None:
    c = source(tmp_path, runtime_dir=str(tmp_path), max_fast_failures=2).load(env={}).config
    flat = flatten(c)
    assert set(flat) == set(KEYS)
    assert flat["max_fast_failures"] == 2 and flat["runtime_dir"] == str(tmp_path)
    assert not plan_reload(c, c).changes


def test_an_address_settled_at_start_is_no_change_on_reload(tmp_path: Path) -> None:
    """A cluster node's advertise_host, unset, is the route to etcd found at start."""
    loaded = ServeConfig(
        tmp_path,
        cluster="etcd://10.0.0.1:2379",
        cluster_key="k",
        migration_transport="nixl",
    )
    running = dataclasses.replace(loaded, advertise_host="10.0.0.2")
    assert not plan_reload(running, loaded).changes
    moved = dataclasses.replace(loaded, advertise_host="10.0.0.3")
    assert set(plan_reload(running, moved).changes) == {"advertise_host"}


def test_cli_values_must_be_keys() -> None:
    with pytest.raises(ValueError, match="not config keys: colour"):
        ConfigSource(cli={"colour": "red"})


def test_env_is_os_environ_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMD_DECODE_WORKERS", "2")
    monkeypatch.delenv("LMD_PORT", raising=False)
    assert source(tmp_path, runtime_dir=str(tmp_path)).load().config.decode_workers == 2


def test_the_example_config_documents_every_key_at_its_default(tmp_path: Path) -> None:
    """systemd/lmd.toml has one `# key = value` line per key: the default where there is
    one, else a valid example; uncommented, the file loads (bar the example model path)."""
    lines = re.findall(r"^# ([a-z_]+ = .+)$", EXAMPLE.read_text(), flags=re.MULTILINE)
    documented = tomllib.loads("\n".join(lines))
    assert sorted(documented) == sorted(KEYS)
    defaults = default_values()
    for key, value in documented.items():
        if defaults[key] not in (None, ()):
            assert value == defaults[key], (
                f"{EXAMPLE}: {key} = {value!r}, default {defaults[key]!r}"
            )
    documented.pop("model")  # an example path that does not exist here
    documented["chat_template"] = "template.json"
    documented["runtime_dir"] = str(tmp_path / "rt")
    documented["migration_transport"] = "nixl"  # what a cluster node (`cluster`) needs
    text = "\n".join(f"{k} = {toml_literal(v)}" for k, v in documented.items())
    loaded = source(tmp_path, text).load(env={})
    assert loaded.config.model_name == documented["model_name"]


def toml_literal(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return repr(value)
