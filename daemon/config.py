"""The daemon's configuration: frozen dataclasses, validated on construction, no I/O.

`ServeConfig` is what `lmdd serve` runs with; the supervisor hands it (as a plain dict)
to every worker it spawns. Loading (command line, environment, TOML file) lives in config_loader.py.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmd.engine.config import MAX_TP, EngineConfig
from lmd.engine.memory_plan import DEFAULT_GPU_MEMORY_UTILIZATION
from lmd.names import NODE_NAME
from lmd.protocol.roles import CLUSTER_ROLES, Role

# fake: the engine around no model; fixed: no engine at all, fixed tokens (hybrid mode
# only). Both for benchmarks and tests.
BACKENDS = ("auto", "torch", "turbo", "fake", "fixed")
MODES = ("disaggregated", "hybrid")
GPU_SHARING = ("time-slice", "mps")  # gpu_sharing.py
DTYPES = ("auto", "float32", "bfloat16", "float16")
# native: lmd._native (host shared memory, CUDA IPC); nixl: NVIDIA NIXL over UCX, the
# optional `lmd[cluster]` install (lmd.migration.nixl).
MIGRATION_TRANSPORTS = ("native", "nixl")
LOG_LEVELS = ("debug", "info", "warning", "error")
# The api's reply parsers (lmd.api.parsers.registry holds them; tests check the names
# agree). auto: the tool-call format the model's chat template names.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("deepseek_r1", "qwen3")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# max_batch_size unset: LMDeploy's default on this class of GPU; on CPU, today's.
DEFAULT_MAX_BATCH_SIZE_CUDA = 256
DEFAULT_MAX_BATCH_SIZE_CPU = 128
# Prompt tokens a prefill step packs. On a CPU a shorter prefill forward fits inside a
# disaggregated decode engine's wait for it (torch_backend/cpu_turns.py, 0.5 s), so the
# two do not compute at once on the same cores (docs/benchmarks.md, "CPU, seventh pass").
DEFAULT_MAX_PREFILL_TOKENS_CUDA = 8192
DEFAULT_MAX_PREFILL_TOKENS_CPU = 384


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the key."""


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How the supervisor restarts a worker that died.

    The delay doubles from `backoff_s` up to `max_backoff_s`. A run shorter than
    `stable_after_s` is a fast failure; `max_fast_failures` in a row and the daemon
    gives up (exit non-zero, so systemd's Restart=on-failure takes over).
    """

    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_after_s: float = 30.0
    max_fast_failures: int = 5

    def __post_init__(self) -> None:
        _check(self.backoff_s > 0, "restart_backoff", "must be > 0 seconds")
        _check(
            self.max_backoff_s >= self.backoff_s,
            "restart_backoff",  # the key users set; max_backoff_s is no key
            f"must be at most {self.max_backoff_s:g} seconds (the longest backoff)",
        )
        _check(self.stable_after_s > 0, "restart_stable_after", "must be > 0 seconds")
        _check(self.max_fast_failures >= 1, "max_fast_failures", "must be >= 1")

    def delay(self, num_fast_failures: int) -> float:
        """Seconds to wait before the next start after `num_fast_failures` in a row."""
        if num_fast_failures <= 0:
            return 0.0
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** (num_fast_failures - 1)))


@dataclass(frozen=True, slots=True)
class ServeConfig:
    runtime_dir: Path
    model: str | None = None  # local HF directory or .gguf file; None = embedded default
    model_name: str | None = None  # served name; derived from the model when None
    host: str = "127.0.0.1"
    port: int = 23333
    mode: str = "disaggregated"  # or hybrid: prefill and decode in one engine process
    device: str = "auto"  # auto = cuda if the driver reports a device, else cpu
    prefill_device: str = "auto"  # auto = device
    decode_device: str = "auto"
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    prefill_backend: str = "auto"
    decode_backend: str = "auto"
    prefill_workers: int = 1
    decode_workers: int = 1
    # Tensor parallelism: each engine worker as a group of this many processes, one per
    # GPU (engine/parallel.py); prefill_tp and decode_tp (disaggregated) override it.
    tp: int = 1
    prefill_tp: int | None = None  # None = tp
    decode_tp: int | None = None  # None = tp
    tokenizer_workers: int = 1  # requests spread over them (api/worker.py: tokenizer_for)
    api_workers: int = 1  # HTTP processes on one port (SO_REUSEPORT; api/worker.py)
    migration_timeout: float = 120.0  # seconds a reservation or a KV copy may take
    migration_transport: str = "native"  # how KV moves between prefill and decode
    gpu_sharing: str = "time-slice"  # or mps: prefill and decode kernels side by side
    mps_prefill_percent: int = 70  # under mps, the multiprocessors a prefill process may use
    drain_timeout: float = 30.0
    startup_timeout: float = 300.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 15.0
    log_level: str = "info"
    api_keys: tuple[str, ...] = ()  # Bearer keys the api accepts; empty = no auth
    max_request_bytes: int = 1 << 20  # largest HTTP request body the api reads
    max_connections: int | None = None  # HTTP connections the api holds; None = per RLIMIT
    header_timeout: float = 10.0  # seconds a client may take to send a request's headers
    chat_template: str | None = None  # a Jinja or LMDeploy JSON file; None = the model's
    session_idle_timeout: float = 600.0  # seconds an idle interactive session is kept
    tool_call_parser: str = "auto"  # how replies to requests with tools are read
    reasoning_parser: str | None = None  # <think> split into reasoning_content; None = off
    # Engine settings (flat, so that CLI flags, env and file keys are the same names).
    block_size: int = 64
    max_batch_size: int | None = None  # None: 256 on CUDA (LMDeploy's), 128 on CPU
    max_prefill_token_num: int | None = None  # None: 8192 on CUDA, 384 on CPU
    # Hybrid: prompt tokens riding in a decode step; None: 256 on CPU, 0 (off) on CUDA.
    mixed_prefill_tokens: int | None = None
    session_len: int | None = None  # prompt + output cap; None = the model's maximum
    cache_max_entry_count: float | int = 0.8  # fraction of free memory, or a block count
    # The part of each GPU's memory the daemon's engines may hold together (as vLLM's).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # On by default (as LMDeploy and vLLM): interactive sessions reuse their KV through it.
    enable_prefix_caching: bool = True
    quantization: str | None = None  # weights quantized at load: fp8 | w4a16; None = as stored
    kv_cache_dtype: str = "auto"  # KV pool: auto (dtype) | int8 | fp8
    # A float32 model's GEMMs on a CPU (> 16 rows; a GGUF's codes at decode): auto =
    # bfloat16 where the CPU has bf16 dot products (AVX512-BF16, AMX), float32 elsewhere.
    cpu_matmul_dtype: str = "auto"
    # Cluster mode (docs/cluster.md): nodes find each other through etcd; None = one host.
    cluster: str | None = None  # etcd://HOST:PORT
    node_name: str | None = None  # this node's name in the cluster; default: the host name
    roles: tuple[str, ...] = ()  # the roles this node runs; empty = every role
    cluster_key: str | None = None  # the cluster's CURVE key file (`lmdd keygen`)
    advertise_host: str | None = None  # where other hosts reach us; default: the route to etcd
    restart: RestartPolicy = dataclasses.field(default_factory=RestartPolicy)

    def __post_init__(self) -> None:
        _check(0 < self.port < 65536, "port", f"{self.port} is not a TCP port (1-65535)")
        _check(bool(self.host), "host", "must not be empty")
        for key in ("device", "prefill_device", "decode_device"):
            value = getattr(self, key)
            _check(
                value in {"auto", "cpu"} or re.fullmatch(r"cuda(:\d+)?", value) is not None,
                key,
                f"{value!r} is not auto, cpu, cuda or cuda:N",
            )
        for key in ("prefill_backend", "decode_backend"):
            value = getattr(self, key)
            _check(value in BACKENDS, key, f"{value!r} is not one of {', '.join(BACKENDS)}")
        only_hybrid = "fixed holds no KV, so it runs only as --mode hybrid --decode-backend fixed"
        hybrid = self.mode == "hybrid"
        _check(self.decode_backend != "fixed" or hybrid, "decode_backend", only_hybrid)
        _check(self.prefill_backend != "fixed", "prefill_backend", only_hybrid)
        for key in ("prefill_workers", "decode_workers", "tokenizer_workers", "api_workers"):
            value = getattr(self, key)
            _check(1 <= value <= 64, key, f"{value} is out of range (1-64)")
        self._check_tp()
        for key in (
            "drain_timeout",
            "migration_timeout",
            "startup_timeout",
            "heartbeat_interval",
            "session_idle_timeout",
        ):
            _check(getattr(self, key) > 0, key, "must be > 0 seconds")
        _check(
            self.heartbeat_timeout >= 3 * self.heartbeat_interval,
            "heartbeat_timeout",
            "must be at least 3x heartbeat_interval",
        )
        object.__setattr__(self, "api_keys", tuple(self.api_keys))  # a list from TOML
        _check(
            all(isinstance(k, str) and k for k in self.api_keys),
            "api_keys",
            "must be non-empty strings",
        )
        _check(self.max_request_bytes >= 1024, "max_request_bytes", "must be >= 1024")
        _check(
            self.max_connections is None or self.max_connections >= 1,
            "max_connections",
            "must be >= 1",
        )
        _check(self.header_timeout > 0, "header_timeout", "must be > 0 seconds")
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"{self.gpu_memory_utilization} is not a fraction in (0, 1]",
        )
        _check(self.mode in MODES, "mode", f"{self.mode!r} is not one of {', '.join(MODES)}")
        _check(
            self.gpu_sharing in GPU_SHARING,
            "gpu_sharing",
            f"{self.gpu_sharing!r} is not one of {', '.join(GPU_SHARING)}",
        )
        _check(
            self.gpu_sharing != "mps" or self.mode == "disaggregated",
            "gpu_sharing",
            "mps shares a GPU between prefill and decode processes; hybrid mode has one",
        )
        _check(1 <= self.mps_prefill_percent <= 100, "mps_prefill_percent", "must be 1-100")
        _check(
            self.tool_call_parser in TOOL_CALL_PARSERS,
            "tool_call_parser",
            f"{self.tool_call_parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}",
        )
        _check(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            "reasoning_parser",
            f"{self.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}",
        )
        _check(
            self.migration_transport in MIGRATION_TRANSPORTS,
            "migration_transport",
            f"{self.migration_transport!r} is not one of {', '.join(MIGRATION_TRANSPORTS)}",
        )
        self._check_cluster()
        _check(self.dtype in DTYPES, "dtype", f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        try:
            self.engine  # noqa: B018 (validates the engine settings)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _check(
            self.log_level in LOG_LEVELS,
            "log_level",
            f"{self.log_level!r} is not one of {', '.join(LOG_LEVELS)}",
        )

    def _check_tp(self) -> None:
        for key in ("tp", "prefill_tp", "decode_tp"):
            value = getattr(self, key)
            _check(
                value is None or 1 <= value <= MAX_TP,
                key,
                f"{value} is out of range (1-{MAX_TP}: one process per GPU)",
            )
        if self.mode == "hybrid":
            for key in ("prefill_tp", "decode_tp"):
                _check(
                    getattr(self, key) is None,
                    key,
                    "applies to disaggregated mode; a hybrid engine's group is tp",
                )
        for role in (Role.PREFILL, Role.DECODE) if self.mode != "hybrid" else (Role.HYBRID,):
            backend = self.prefill_backend if role == Role.PREFILL else self.decode_backend
            size = self.tp_of(role)
            _check(
                size == 1 or backend not in ("fake", "fixed"),
                "tp" if role == Role.HYBRID else f"{role}_tp",
                f"{size} needs a model: backend {backend} runs no tensor parallelism",
            )

    def tp_of(self, role: Role) -> int:
        """The tensor-parallel size of an engine role's workers (1 for the other roles)."""
        if role == Role.PREFILL and self.prefill_tp is not None:
            return self.prefill_tp
        if role == Role.DECODE and self.decode_tp is not None:
            return self.decode_tp
        return self.tp if role.is_engine else 1

    def _check_cluster(self) -> None:
        object.__setattr__(self, "roles", tuple(self.roles))  # a list from TOML
        bad = [r for r in self.roles if r not in CLUSTER_ROLES]
        _check(not bad, "roles", f"{bad} are not among {', '.join(CLUSTER_ROLES)}")
        if self.cluster is None:
            _check(not self.roles, "roles", "only a cluster node (--cluster) runs some roles")
            return
        _check(
            re.fullmatch(r"etcd://[^:/\s]+:\d{1,5}", self.cluster) is not None,
            "cluster",
            f"{self.cluster!r} is not etcd://HOST:PORT",
        )
        _check(
            self.node_name is None or NODE_NAME.fullmatch(self.node_name) is not None,
            "node_name",
            f"{self.node_name!r} is not 1-32 letters, digits or _",
        )
        _check(
            self.cluster_key is not None,
            "cluster_key",
            "a cluster node needs the cluster's key file (create one with `lmdd keygen PATH` "
            "and copy it to every node)",
        )
        _check(self.mode == "disaggregated", "mode", "a cluster node runs disaggregated")
        _check(
            self.migration_transport == "nixl",
            "migration_transport",
            "KV moves between cluster nodes over nixl: add --migration-transport nixl",
        )

    @property
    def node(self) -> str:
        """This node's name in the cluster; "" for a single-host daemon."""
        if self.cluster is None:
            return ""
        if self.node_name:
            return self.node_name
        return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:32] or "node"

    @property
    def engine(self) -> EngineConfig:
        """The engine settings of a CPU engine (engine_on gives a device's)."""
        return self.engine_on("cpu")

    def engine_on(self, device: str | None) -> EngineConfig:
        """The engine settings of an engine on `device`: max_batch_size and
        max_prefill_token_num unset are their DEFAULT_*_CUDA on a GPU, *_CPU on CPU."""
        on_gpu = (device or "").startswith("cuda")
        batch = self.max_batch_size
        if batch is None:
            batch = DEFAULT_MAX_BATCH_SIZE_CUDA if on_gpu else DEFAULT_MAX_BATCH_SIZE_CPU
        prefill = self.max_prefill_token_num
        if prefill is None:
            prefill = DEFAULT_MAX_PREFILL_TOKENS_CUDA if on_gpu else DEFAULT_MAX_PREFILL_TOKENS_CPU
        return EngineConfig(
            block_size=self.block_size,
            max_batch_size=batch,
            max_prefill_token_num=prefill,
            mixed_prefill_tokens=self.mixed_prefill_tokens,
            session_len=self.session_len,
            cache_max_entry_count=self.cache_max_entry_count,
            enable_prefix_caching=self.enable_prefix_caching,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            cpu_matmul_dtype=self.cpu_matmul_dtype,
        )

    def role_device(self, role: Role, resolved: str) -> str:
        """The device of an engine role; `resolved` is `device` with auto resolved.

        Prefill and decode must both be on cpu or both on CUDA (the migration
        transport is shared memory or CUDA IPC); ConfigError says so otherwise.
        """
        devices: dict[str, str] = {}
        for r in (Role.PREFILL, Role.DECODE):
            own = getattr(self, f"{r}_device")
            devices[r] = resolved if own == "auto" else own
        prefill, decode = devices[Role.PREFILL], devices[Role.DECODE]
        if self.mode == "disaggregated" and (prefill == "cpu") != (decode == "cpu"):
            raise ConfigError(
                f"prefill_device: {prefill} and decode_device {decode} "
                "must both be cpu or both cuda (KV migrates over shared memory or CUDA IPC)"
            )
        return devices.get(role, resolved)

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.model is None:
            return DEFAULT_MODEL_NAME
        path = Path(self.model.rstrip("/"))
        return path.stem if path.suffix == ".gguf" else path.name

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, as shown by status and handed to workers."""
        out = dataclasses.asdict(self)
        out["runtime_dir"] = str(self.runtime_dir)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServeConfig:
        fields = dict(data)
        fields["runtime_dir"] = Path(fields["runtime_dir"])
        fields["restart"] = RestartPolicy(**fields.get("restart", {}))
        return cls(**fields)
