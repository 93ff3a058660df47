"""`lmdd`: the daemon's command line.

lmdd serve [MODEL] [--config PATH] [--host H] [--port P] [--runtime-dir DIR] ...
lmdd version
lmdd keygen PATH

Settings: command line > LMD_<KEY> environment variables > config file > defaults
(config_loader.py). A bad setting is one line on stderr and exit code 2; a model that no
worker could load (supervisor/model_check.py), or a --chat-template file the tokenizer
could not use, is one line and exit code 1, nothing spawned.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lmd import __version__
from lmd.config import (
    BACKENDS,
    DTYPES,
    GPU_SHARING,
    LOG_LEVELS,
    MIGRATION_TRANSPORTS,
    MODES,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ConfigError,
    ServeConfig,
)
from lmd.config_loader import (
    DEFAULT_CONFIG_PATH,
    KEYS,
    PATH_KEYS,
    ConfigSource,
    Kind,
    LoadedConfig,
    default_values,
    parse_value,
)
from lmd.engine.config import CPU_MATMUL_DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS
from lmd.protocol.roles import Role

log = logging.getLogger("lmd")


# Help for each config key's flag; a key without an entry still gets its flag.
HELP = {
    "runtime_dir": "sockets and lock; default $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/lmd, "
    "else <tmp>/lmd-<uid>",
    "model_name": "name served in /v1/models (default: from MODEL)",
    "host": "address the HTTP API listens on",
    "port": "HTTP API port",
    "mode": "disaggregated (prefill and decode processes) or hybrid (one engine process)",
    "device": "auto (cuda if the driver reports a device, else cpu), cpu, cuda, cuda:N",
    "prefill_device": "device of the prefill processes (default: --device)",
    "decode_device": "device of the decode processes (default: --device); prefill and "
    "decode are both cpu or both cuda",
    "migration_timeout": "seconds a KV reservation or copy between prefill and decode may "
    "take before the request fails",
    "migration_transport": "how KV moves from prefill to decode: native (shared memory or "
    "CUDA IPC, one host) or nixl (NVIDIA NIXL over UCX; needs `pip install lmd[cluster]`)",
    "gpu_sharing": "how prefill and decode processes on one GPU share it: time-slice (the "
    "driver's default: one process's kernels at a time) or mps (NVIDIA MPS: side by side, "
    "more tokens/s; a GPU fault in one then stops both)",
    "mps_prefill_percent": "with --gpu-sharing mps: the share of the multiprocessors a "
    "prefill process may use (decode may use all)",
    "dtype": "weights and KV cache dtype; auto = bfloat16 on CUDA, float32 on CPU",
    "prefill_backend": "engine backend of the prefill processes",
    "decode_backend": "engine backend of the decode processes",
    "prefill_workers": "number of prefill processes",
    "decode_workers": "number of decode processes",
    "tokenizer_workers": "number of tokenizer processes (requests spread over them; "
    "each interactive session stays on one)",
    "api_workers": "number of HTTP api processes sharing --port (the kernel spreads "
    "connections over them; /metrics adds up all of them)",
    "drain_timeout": "seconds to finish in-flight requests on SIGTERM",
    "startup_timeout": "seconds a worker may take to become ready",
    "heartbeat_interval": "seconds between a worker's heartbeats",
    "heartbeat_timeout": "seconds without a heartbeat before a worker is replaced",
    "log_level": "log level (`lmdctl reload` applies a new one without a restart)",
    "api_keys": "comma-separated Bearer keys the API accepts (default: none, no auth); "
    "visible in ps: prefer LMD_API_KEYS or the config file",
    "max_request_bytes": "largest HTTP request body the API reads",
    "max_connections": "HTTP connections the API holds open; past it new ones get 503 "
    "(default: what the open-files limit leaves, less 64)",
    "header_timeout": "seconds a client may take to send its request headers",
    "chat_template": "chat template file: Jinja (*.jinja, *.j2, or any file that is not "
    "JSON) or LMDeploy's JSON (default: the model's own template)",
    "session_idle_timeout": "seconds an idle /v1/chat/interactive session keeps its history",
    "tool_call_parser": "how the tool calls of a reply are read: auto (the format the "
    "model's chat template names), " + ", ".join(TOOL_CALL_PARSERS[1:]),
    "reasoning_parser": "split <think>...</think> off into reasoning_content: "
    + ", ".join(REASONING_PARSERS)
    + " (default: none, the reply is content as it is)",
    "block_size": "tokens per KV cache block",
    "max_batch_size": "most sequences an engine runs in one batch (default: 256 on CUDA, "
    "128 on CPU)",
    "max_prefill_token_num": "most prompt tokens in one prefill step (default: 8192 on "
    "CUDA, 384 on CPU, where a short prefill forward leaves the cores to decode sooner)",
    "mixed_prefill_tokens": "hybrid mode: prompt tokens a decode step carries in its "
    "forward while prompts wait (more when many wait: an eighth of them); 0: prompts get "
    "prefill steps of their own, which pause every decoding sequence (default: 256 on "
    "CPU, 0 on CUDA, where such a step runs outside the CUDA graphs)",
    "session_len": "prompt + output token cap (default: the model's context length)",
    "cache_max_entry_count": "KV cache size: a fraction (0, 1] of the free device memory "
    "after the weights (of the engine's share of the GPU when engines share one), or an "
    "integer block count",
    "gpu_memory_utilization": "fraction (0, 1] of each GPU's memory the daemon's engines may "
    "hold together (weights, activations, CUDA graphs, KV cache)",
    "enable_prefix_caching": "reuse the KV blocks of a prompt prefix seen before "
    "(/v1/chat/interactive needs it)",
    "quantization": "quantize the weights' linear layers at load (backend turbo, CUDA): "
    "w4a16 (4-bit, groups of 128) or fp8 (e4m3, Hopper); default: as the checkpoint has them "
    "(AWQ, GPTQ and FP8 checkpoints need no flag)",
    "kv_cache_dtype": "KV cache element type: auto (--dtype), int8 or fp8, each with a "
    "scale per token and head (backend turbo, CUDA)",
    "cpu_matmul_dtype": "input type of a float32 model's GEMMs on a CPU (of more than 16 "
    "rows, and a GGUF's coded weights at decode): bfloat16 runs about twice float32's rate "
    "where the CPU has bf16 dot products (AVX512-BF16, AMX), summing in float32; auto: "
    "bfloat16 there, float32 elsewhere",
    "cluster": "join the cluster whose membership lives in this etcd (etcd://HOST:PORT)",
    "node_name": "this node's name in the cluster (default: the host name)",
    "roles": "the roles this cluster node runs: api,tokenizer,prefill,decode (default: all)",
    "cluster_key": "the cluster's key file (`lmdd keygen PATH`): signs membership and "
    "authenticates links between hosts (CURVE)",
    "advertise_host": "the address other cluster hosts reach this node at (default: this "
    "host's address on the route to etcd)",
    "restart_backoff": "first delay before restarting a worker that died young, doubling",
    "max_fast_failures": "young deaths in a row of one worker before the daemon gives up",
}
CHOICES = {
    "mode": MODES,
    "dtype": DTYPES,
    "prefill_backend": BACKENDS,
    "decode_backend": BACKENDS,
    "log_level": LOG_LEVELS,
    "migration_transport": MIGRATION_TRANSPORTS,
    "gpu_sharing": GPU_SHARING,
    "quantization": QUANTIZATIONS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "cpu_matmul_dtype": CPU_MATMUL_DTYPES,
}


_METAVARS = {Kind.INT: "N", Kind.FLOAT: "X", Kind.NUMBER: "X", Kind.STRINGS: "A,B,..."}


def _flag_type(key: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return parse_value(key, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = KEYS[key].value  # argparse names it in "invalid <name> value"
    return parse


def _add_flag(serve: argparse.ArgumentParser, key: str) -> None:
    default = default_values()[key]
    help_text = HELP.get(key, key.replace("_", " "))
    if default is not None and default != () and "(default" not in help_text:
        help_text += f" (default: {str(default).lower() if isinstance(default, bool) else default})"
    flag = "--" + key.replace("_", "-")
    if KEYS[key] is Kind.BOOL:
        serve.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
    elif key in CHOICES:
        serve.add_argument(flag, choices=CHOICES[key], help=help_text)
    else:
        metavar = "PATH" if key in PATH_KEYS else _METAVARS.get(KEYS[key], "")
        metavar = metavar or key.rsplit("_", 1)[-1].upper()  # --host HOST, --model-name NAME
        serve.add_argument(flag, type=_flag_type(key), metavar=metavar, help=help_text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmdd", description="lmd serving daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    keygen_parser = sub.add_parser(
        "keygen",
        help="write a new cluster key file (mode 0600); every node of the cluster needs a copy",
    )
    keygen_parser.add_argument("path", metavar="PATH", help="the file to create (never replaced)")
    # No defaults here: a flag left out is absent from the namespace, so that LMD_* and
    # the config file can set it (config_loader applies the precedence and the defaults).
    serve = sub.add_parser(
        "serve",
        help="run the daemon in the foreground",
        argument_default=argparse.SUPPRESS,
        epilog="Every option can also be set as LMD_<OPTION> (e.g. LMD_PORT=8000) or as a "
        "key in the config file (e.g. port = 8000); the command line wins, then the "
        "environment, then the file.",
    )
    serve.add_argument(
        "model",
        nargs="?",
        help="local HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    serve.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML config file (default: {DEFAULT_CONFIG_PATH} if it exists)",
    )
    for key in KEYS:
        if key != "model":
            _add_flag(serve, key)
    return parser


def config_source(args: argparse.Namespace) -> ConfigSource:
    """The flags given (absent ones stay absent) and the --config file, for loading."""
    given = {k: v for k, v in vars(args).items() if k in KEYS}
    path = getattr(args, "config", None)
    return ConfigSource(cli=given, path=Path(path) if path else None)


def build_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ServeConfig:
    """The ServeConfig for `lmdd serve ARGS` (raises ConfigError naming the key)."""
    return config_source(args).load(env).config


def resolve_device(device: str) -> str:
    """`auto` is cuda when the CUDA driver reports a device, else cpu (with the reason)."""
    if device != "auto":
        return device
    from lmd import _native

    probe = _native.probe_cuda()
    if probe["available"]:
        return "cuda"
    log.info("no usable GPU (%s); running on cpu", probe["reason"])
    return "cpu"


def check_chat_template(config: ServeConfig) -> None:
    """A --chat-template file the tokenizer could not use: ChatTemplateError, one line."""
    from lmd.roles import role_counts

    if config.chat_template and Role.TOKENIZER in role_counts(config):
        from lmd.tokenizer.text.chat_template import read_chat_template

        read_chat_template(Path(config.chat_template))


def check_api_port(config: ServeConfig) -> None:
    """Several api processes share the port through SO_REUSEPORT, which another process of
    this user could join too: it must be free when the daemon starts (BindError)."""
    from lmd.http_server import bind_tcp
    from lmd.roles import role_counts

    if role_counts(config).get(Role.API, 0) > 1:
        bind_tcp(config.host, config.port).close()


def check_before_start(config: ServeConfig) -> None:
    """Once, before any worker starts: what no worker could get past would only restart
    them until the daemon gave up (ModelSourceError, ValueError, BindError)."""
    from lmd.supervisor.model_check import check_daemon_model

    check_daemon_model(config)
    check_chat_template(config)  # a ChatTemplateError is a ValueError
    check_api_port(config)


def serve(args: argparse.Namespace) -> int:
    from lmd.engine.model_source import ModelSourceError
    from lmd.http_server import BindError
    from lmd.paths import RuntimeDirError, prepare_runtime_dir
    from lmd.supervisor.limits import raise_open_files_limit
    from lmd.supervisor.runtime_lock import AlreadyRunning
    from lmd.worker import configure_logging

    try:
        loaded = config_source(args).load()
    except ConfigError as exc:
        print(f"lmdd: {exc}", file=sys.stderr)
        return 2
    config = loaded.config
    configure_logging(config.log_level, "lmdd")
    raise_open_files_limit()  # before any worker is spawned: they inherit it
    try:
        check_before_start(config)
    except (ModelSourceError, ValueError, BindError) as exc:
        print(f"lmdd: {exc}", file=sys.stderr)
        return 1
    try:
        prepare_runtime_dir(config.runtime_dir)
    except RuntimeDirError as exc:
        log.error("%s", exc)
        return 1

    import uvloop
    from setproctitle import setproctitle

    from lmd.spawn import process_title
    from lmd.supervisor.control import build_control_app
    from lmd.supervisor.model_check import check_engines
    from lmd.supervisor.sd_notify import Notifier
    from lmd.supervisor.supervisor import Supervisor

    # Read $NOTIFY_SOCKET before any worker is spawned, and unset it: only we speak to
    # systemd (NotifyAccess=main), workers report to us.
    notifier = Notifier.from_environ()
    device = resolve_device(config.device)
    try:
        config.role_device(Role.PREFILL, device)  # prefill and decode devices must pair up
        check_engines(config, device)
    except ConfigError as exc:
        print(f"lmdd: {exc}", file=sys.stderr)
        return 2
    if config.migration_transport == "nixl" and config.mode == "disaggregated":
        from lmd.migration import nixl

        if not nixl.installed():
            print(f"lmdd: migration_transport: {nixl.INSTALL_HINT}", file=sys.stderr)
            return 2
    if config.cluster is not None:
        try:
            loaded = _cluster_ready(loaded)
        except (OSError, ValueError) as exc:
            print(f"lmdd: {exc}", file=sys.stderr)
            return 2
    setproctitle(process_title("supervisor"))  # ps: `lmd: supervisor`, workers `lmd: decode-0`
    supervisor = Supervisor(loaded, device, os.getpid(), build_control_app, notifier)
    try:
        code: int = uvloop.run(supervisor.run())
    except AlreadyRunning as exc:
        log.error("%s", exc)
        return 1
    return code


def _cluster_ready(loaded: LoadedConfig) -> LoadedConfig:
    """Check the cluster key file, and settle the address other nodes reach us at."""
    from lmd.cluster.keys import ClusterKey
    from lmd.cluster.node import route_address

    config = loaded.config
    assert config.cluster is not None and config.cluster_key is not None
    ClusterKey.load(Path(config.cluster_key))  # a missing or open key: one line, exit 2
    if config.advertise_host:
        return loaded
    try:
        host = route_address(config.cluster)
    except OSError as exc:
        raise OSError(
            f"cluster: no route to {config.cluster} ({exc}); set --advertise-host"
        ) from None
    return dataclasses.replace(loaded, config=dataclasses.replace(config, advertise_host=host))


def keygen(path: str) -> int:
    """Write a new cluster key to PATH (mode 0600; an existing file is left alone)."""
    from lmd.cluster.keys import ClusterKey

    try:
        ClusterKey.generate().save(path)
    except ValueError as exc:
        print(f"lmdd: {exc}", file=sys.stderr)
        return 1
    print(
        f"lmdd: wrote a new cluster key to {path} (mode 0600); every node of the cluster "
        "needs a copy (--cluster-key)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "version":
        print(f"lmdd {__version__}")
        return 0
    if args.command == "keygen":
        return keygen(args.path)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
