"""Where `lmdd serve` takes its settings from: command line > LMD_* env > TOML file > defaults.

Every key exists in all three places under one name: the config file's key (snake_case,
top level), the variable `LMD_<KEY>` (e.g. LMD_PORT) and the flag `--<key>` with dashes.
The keys are ServeConfig's fields (its `restart` policy as restart_backoff and
max_fast_failures), with types from its annotations, so a field added there is a key
here. The file is `--config PATH`, else /etc/lmd/lmd.toml when it exists. Paths in the
file (PATH_KEYS) may be relative to the file's directory. In the environment an empty
variable counts as unset, lists are comma-separated and booleans are true/false
(1/0, yes/no, on/off). Anything wrong (an unknown key, a value of the wrong type or out
of range) is a ConfigError whose one line names the key and where it came from.

`ConfigSource.load()` reads the file and the environment; the supervisor calls it again
on `lmdctl reload` and `plan_reload` sorts the differences into what applies live
(LIVE_KEYS) and what needs a restart. The dataclasses here do no I/O when built.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmd.config import ConfigError, RestartPolicy, ServeConfig
from lmd.paths import resolve_runtime_dir

DEFAULT_CONFIG_PATH = Path("/etc/lmd/lmd.toml")
ENV_PREFIX = "LMD_"


class Kind(enum.Enum):
    """The type of a key's value, as TOML, the environment and argparse give it."""

    STR = "a string"
    INT = "an integer"
    FLOAT = "a number"  # an integer is taken too, as a float
    NUMBER = "an integer or a float"  # kept as given (cache_max_entry_count: count or share)
    BOOL = "a boolean"
    STRINGS = "an array of strings"


RESTART_FIELDS = {"restart_backoff": "backoff_s", "max_fast_failures": "max_fast_failures"}
PATH_KEYS = frozenset({"model", "runtime_dir", "chat_template", "cluster_key"})
SECRET_KEYS = frozenset({"api_keys"})  # never shown: /v1/config and reload redact them
# Keys lmdd settles at start when they are unset (cli.py); unset again in a reload, they
# keep that value rather than count as changed.
DERIVED_AT_START = frozenset({"advertise_host"})
# What `lmdctl reload` can change in a running daemon; every other key needs a restart.
LIVE_KEYS = frozenset({"log_level", "api_keys", "max_request_bytes"})

DEFAULT = "default"
COMMAND_LINE = "command line"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# Integers must fit in int64: workers, the control API and the wire carry values as JSON
# (orjson), which refuses anything wider, so a wider one must be refused here, up front.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1


def _kind_of(hint: Any) -> Kind:
    args = (
        set(typing.get_args(hint)) - {type(None)} if isinstance(hint, types.UnionType) else {hint}
    )
    kinds = {
        frozenset({str}): Kind.STR,
        frozenset({Path}): Kind.STR,
        frozenset({int}): Kind.INT,
        frozenset({float}): Kind.FLOAT,
        frozenset({float, int}): Kind.NUMBER,
        frozenset({bool}): Kind.BOOL,
        frozenset({tuple[str, ...]}): Kind.STRINGS,
    }
    kind = kinds.get(frozenset(args))
    if kind is None:
        raise TypeError(f"ServeConfig field type {hint} has no config_loader.Kind: add one")
    return kind


def _keys() -> dict[str, Kind]:
    hints = typing.get_type_hints(ServeConfig)
    fields = [f.name for f in dataclasses.fields(ServeConfig) if f.name != "restart"]
    out = {name: _kind_of(hints[name]) for name in fields}
    restart = typing.get_type_hints(RestartPolicy)
    out.update({k: _kind_of(restart[f]) for k, f in RESTART_FIELDS.items()})
    return out


KEYS: dict[str, Kind] = _keys()  # key -> kind, in ServeConfig's field order


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def default_values() -> dict[str, Any]:
    """Each key's default (None: unset, or derived at load like runtime_dir)."""
    serve = {f.name: _default(f) for f in dataclasses.fields(ServeConfig)}
    restart = {f.name: _default(f) for f in dataclasses.fields(RestartPolicy)}
    out = {k: restart[RESTART_FIELDS[k]] if k in RESTART_FIELDS else serve[k] for k in KEYS}
    out["runtime_dir"] = None
    return out


def flatten(config: ServeConfig) -> dict[str, Any]:
    """The config by key (what reload compares); lists as lists, paths as strings."""
    out = {k: getattr(config, k) for k in KEYS if k not in RESTART_FIELDS}
    out.update({k: getattr(config.restart, f) for k, f in RESTART_FIELDS.items()})
    out["runtime_dir"] = str(config.runtime_dir)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def shown(key: str, value: Any) -> Any:
    """`value` as /v1/config and reload show it: secrets redacted, one per entry."""
    if key in SECRET_KEYS and value:
        return ["<redacted>"] * len(value)
    return value


def _a(value: Any) -> str:
    """TOML's name for the type of `value`, with an article."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return "a date or time"


def _in_range(value: Any) -> Any:
    """`value` unless it is a number JSON cannot carry (NaN, inf, an int past int64)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} is not a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"{value} is out of range (it does not fit in a 64-bit integer)")
    return value


def expand_path(text: str) -> str:
    """`text` with ~ and ~user expanded; raises ValueError for a user with no home."""
    try:
        return str(Path(text).expanduser())
    except RuntimeError:  # pathlib's "Could not determine home directory"
        raise ValueError(f"cannot expand {text!r}: no such user or no home directory") from None


def _typed(key: str, value: Any) -> Any:
    """`value` from the TOML file as KEYS[key]; raises ValueError saying what is wrong."""
    kind = KEYS[key]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = {
        Kind.STR: isinstance(value, str),
        Kind.INT: isinstance(value, int) and not isinstance(value, bool),
        Kind.FLOAT: number,
        Kind.NUMBER: number,
        Kind.BOOL: isinstance(value, bool),
        Kind.STRINGS: isinstance(value, list) and all(isinstance(v, str) for v in value),
    }[kind]
    if not ok:
        raise ValueError(f"expected {kind.value}, got {_a(value)} ({value!r})")
    if kind is Kind.STR and not value:
        raise ValueError("must not be empty (leave the key out for the default)")
    if kind is Kind.STRINGS:
        return tuple(value)
    value = _in_range(value)
    return float(value) if kind is Kind.FLOAT else value


def parse_value(key: str, text: str) -> Any:
    """`text` (an LMD_* variable, a flag) as KEYS[key]; raises ValueError."""
    kind = KEYS[key]
    if kind is Kind.STR:
        return text
    if kind is Kind.STRINGS:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if kind is Kind.BOOL:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{text!r} is not a boolean (true/false, 1/0, yes/no, on/off)")
    try:
        value: int | float = int(text)
    except ValueError:
        try:
            if kind is Kind.INT:
                raise
            value = float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not {kind.value}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    value = _in_range(value)
    return float(value) if kind is Kind.FLOAT else value


def _unknown(key: str) -> str:
    close = difflib.get_close_matches(key, KEYS, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(KEYS)}"
    return f"unknown key {key!r} ({hint})"


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """A ServeConfig with where each key's value came from (see ConfigSource.load)."""

    config: ServeConfig
    origins: Mapping[str, str]  # key -> "default", "command line", "env LMD_X", "file PATH"
    source: ConfigSource  # load() it again to reload
    file: Path | None = None  # the config file that was read, if any
    needs_restart: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # key -> value
    # loaded by a reload that could not apply it to the running daemon

    def to_json(self) -> dict[str, Any]:
        return {
            "file": str(self.file) if self.file else None,
            "values": {k: shown(k, v) for k, v in flatten(self.config).items()},
            "origins": dict(self.origins),
            "needs_restart": {k: shown(k, v) for k, v in self.needs_restart.items()},
        }


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """The flags given on the command line and the config file named (or the default)."""

    cli: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # only flags given
    path: Path | None = None  # --config; None = default_path if it exists
    default_path: Path = DEFAULT_CONFIG_PATH

    def __post_init__(self) -> None:
        if unknown := set(self.cli) - set(KEYS):
            raise ValueError(f"not config keys: {', '.join(sorted(unknown))}")

    def load(self, env: Mapping[str, str] | None = None) -> LoadedConfig:
        """Read the file and `env` (default os.environ); raise ConfigError naming the key."""
        env = os.environ if env is None else env
        values, origins = default_values(), dict.fromkeys(KEYS, DEFAULT)
        file = self._file_to_read()
        if file is not None:
            for key, value in self._read_file(file).items():
                values[key], origins[key] = value, f"file {file}"
        for key in KEYS:
            var = ENV_PREFIX + key.upper()
            if text := env.get(var, ""):
                try:
                    values[key] = expand_path(text) if key in PATH_KEYS else parse_value(key, text)
                except ValueError as exc:
                    raise ConfigError(f"{var}: {key}: {exc}") from None
                origins[key] = f"env {var}"
        for key, value in self.cli.items():
            values[key], origins[key] = value, COMMAND_LINE
        config = _build(values, origins, env)
        return LoadedConfig(config, origins, self, file)

    def _file_to_read(self) -> Path | None:
        if self.path is not None:
            if not self.path.is_file():
                raise ConfigError(f"config file {self.path} does not exist or is not a file")
            return self.path
        return self.default_path if self.default_path.is_file() else None

    def _read_file(self, path: Path) -> dict[str, Any]:
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read it: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        except UnicodeDecodeError as exc:  # tomllib decodes the whole file first
            raise ConfigError(
                f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                f"{exc.start}): TOML files are UTF-8, save it as UTF-8"
            ) from None
        out = {}
        for key, value in data.items():
            if key not in KEYS:
                raise ConfigError(f"{path}: {_unknown(key)}")
            try:
                out[key] = _typed(key, value)
                if key in PATH_KEYS:  # relative to the file, not to wherever lmdd was started
                    out[key] = str(path.absolute().parent / expand_path(out[key]))
            except ValueError as exc:
                raise ConfigError(f"{path}: {key}: {exc}") from None
        return out


def _where(origin: str) -> str:
    """The prefix of an error about a value from `origin` ('' for flags and defaults)."""
    if origin.startswith(("file ", "env ")):
        return origin.split(" ", 1)[1] + ": "
    return ""


def _build(
    values: dict[str, Any], origins: Mapping[str, str], env: Mapping[str, str]
) -> ServeConfig:
    model = values["model"]
    if model is not None and not os.path.exists(model):
        raise ConfigError(f"{_where(origins['model'])}model: {model} does not exist")
    fields = {k: v for k, v in values.items() if k not in RESTART_FIELDS}
    runtime_dir = values["runtime_dir"]
    if runtime_dir is not None:
        try:
            runtime_dir = expand_path(runtime_dir)
        except ValueError as exc:
            raise ConfigError(f"{_where(origins['runtime_dir'])}runtime_dir: {exc}") from None
    fields["runtime_dir"] = resolve_runtime_dir(runtime_dir, env)
    try:
        restart = RestartPolicy(**{f: values[k] for k, f in RESTART_FIELDS.items()})
        return ServeConfig(**fields, restart=restart)
    except ConfigError as exc:  # the message starts with the key: say where it was set
        key = match.group(0) if (match := re.match(r"[a-z_]+", str(exc))) else ""
        raise ConfigError(f"{_where(origins.get(key, DEFAULT))}{exc}") from None


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What differs between the running config and the one just loaded."""

    changes: Mapping[str, tuple[Any, Any]]  # key -> (running value, loaded value)

    @property
    def applied(self) -> list[str]:
        return [k for k in self.changes if k in LIVE_KEYS]

    @property
    def needs_restart(self) -> list[str]:
        return [k for k in self.changes if k not in LIVE_KEYS]

    def to_json(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "needs_restart": self.needs_restart,
            "changes": {
                k: {"from": shown(k, a), "to": shown(k, b)} for k, (a, b) in self.changes.items()
            },
        }


def plan_reload(running: ServeConfig, loaded: ServeConfig) -> ReloadPlan:
    old, new = flatten(running), flatten(loaded)
    return ReloadPlan(
        {
            k: (old[k], new[k])
            for k in KEYS
            if old[k] != new[k] and not (k in DERIVED_AT_START and new[k] is None)
        }
    )


def reload_config(running: LoadedConfig) -> tuple[LoadedConfig, ReloadPlan]:
    """Load `running`'s source again: the new live values, the old ones for the rest."""
    loaded = running.source.load()
    plan = plan_reload(running.config, loaded.config)
    live = {k: plan.changes[k][1] for k in plan.applied}  # LIVE_KEYS are ServeConfig fields
    config = dataclasses.replace(running.config, **live)
    origins = {**running.origins, **{k: loaded.origins[k] for k in live}}
    pending = {k: plan.changes[k][1] for k in plan.needs_restart}
    return LoadedConfig(config, origins, running.source, loaded.file, pending), plan
