from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmd.cli import _parser, build_config
from lmd.config import ConfigError, RestartPolicy, ServeConfig


def test_defaults_match_the_design() -> None:
    c = ServeConfig(runtime_dir=Path("/run/lmd"))
    assert (c.host, c.port, c.device) == ("127.0.0.1", 23333, "auto")
    assert (c.prefill_workers, c.decode_workers) == (1, 1)
    assert c.served_model_name == "SmolLM2-135M-Instruct"
    # Interactive sessions reuse their KV through the prefix cache: on, as in LMDeploy.
    assert c.enable_prefix_caching is True and c.engine.enable_prefix_caching is True
    assert c.session_idle_timeout == 600.0
    # LMDeploy's batch on a GPU of this class, today's on CPU; 0.9 of each GPU (vLLM's)
    assert c.engine_on("cuda:1").max_batch_size == 256
    assert c.engine_on("cpu").max_batch_size == c.engine.max_batch_size == 128
    assert ServeConfig(Path("/r"), max_batch_size=64).engine_on("cuda").max_batch_size == 64
    # prefill steps: shorter on a CPU, where prefill and decode take turns on the cores
    assert c.engine_on("cuda:0").max_prefill_token_num == 8192
    assert c.engine_on("cpu").max_prefill_token_num == 384
    assert ServeConfig(Path("/r"), max_prefill_token_num=1024).engine.max_prefill_token_num == 1024
    assert c.gpu_memory_utilization == 0.9


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"device": "tpu"}, "device"),
        ({"prefill_backend": "vllm"}, "prefill_backend"),
        ({"decode_workers": 0}, "decode_workers"),
        ({"drain_timeout": 0}, "drain_timeout"),
        ({"heartbeat_timeout": 2.0}, "heartbeat_timeout"),
        ({"log_level": "loud"}, "log_level"),
        ({"session_idle_timeout": 0}, "session_idle_timeout"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
    ],
)
def test_bad_values_name_the_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: "):
        ServeConfig(runtime_dir=Path("/run/lmd"), **kwargs)


def test_served_name_from_the_model_path() -> None:
    rd = Path("/r")
    assert ServeConfig(rd, model="/m/Llama-3-8B/").served_model_name == "Llama-3-8B"
    assert ServeConfig(rd, model="/m/tiny.Q4_0.gguf").served_model_name == "tiny.Q4_0"
    assert ServeConfig(rd, model="/m/x", model_name="prod").served_model_name == "prod"


def test_dict_round_trip_for_workers() -> None:
    c = ServeConfig(Path("/r"), port=9000, restart=RestartPolicy(backoff_s=0.2))
    assert ServeConfig.from_dict(c.to_dict()) == c


def test_backoff_doubles_and_caps() -> None:
    p = RestartPolicy(backoff_s=0.5, max_backoff_s=3.0)
    assert [p.delay(n) for n in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ConfigError, match="max_fast_failures"):
        RestartPolicy(max_fast_failures=0)


def test_cli_flags_reach_the_config(tmp_path: Path) -> None:
    args = _parser().parse_args(
        [
            "serve",
            "--port",
            "8000",
            "--runtime-dir",
            str(tmp_path),
            "--decode-workers",
            "2",
            "--max-fast-failures",
            "2",
        ]
    )
    c = build_config(args)
    assert (c.port, c.runtime_dir, c.decode_workers) == (8000, tmp_path, 2)
    assert c.restart.max_fast_failures == 2


def test_cli_rejects_a_missing_model(tmp_path: Path) -> None:
    args = _parser().parse_args(["serve", str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(args)


CLUSTER: dict[str, Any] = {
    "cluster": "etcd://10.0.0.1:2379",
    "cluster_key": "/etc/lmd/cluster.key",
    "migration_transport": "nixl",
}


@pytest.mark.parametrize(
    ("kwargs", "key", "says"),
    [
        ({**CLUSTER, "cluster": "http://10.0.0.1:2379"}, "cluster", "etcd://HOST:PORT"),
        ({**CLUSTER, "cluster_key": None}, "cluster_key", "lmdd keygen"),
        ({**CLUSTER, "migration_transport": "native"}, "migration_transport", "nixl"),
        ({**CLUSTER, "mode": "hybrid"}, "mode", "disaggregated"),
        ({**CLUSTER, "node_name": "a.b"}, "node_name", "letters, digits or _"),
        ({**CLUSTER, "roles": ("decode", "hybrid")}, "roles", "hybrid"),
        ({"roles": ("decode",)}, "roles", "--cluster"),
    ],
)
def test_cluster_settings_are_checked(kwargs: dict[str, Any], key: str, says: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: .*{says}"):
        ServeConfig(runtime_dir=Path("/run/lmd"), **kwargs)


def test_a_cluster_node_names_itself_and_its_workers() -> None:
    from lmd.roles import plan_workers

    node = ServeConfig(Path("/run/lmd"), **CLUSTER, node_name="b", roles=("decode",))
    assert node.node == "b"
    assert [s.name for s in plan_workers(node, "cpu", 1)] == ["decode-0@b"]
    assert ServeConfig(Path("/run/lmd")).node == ""  # one host: plain names
    unnamed = ServeConfig(Path("/run/lmd"), **CLUSTER)  # default: the host name
    assert unnamed.node and all(ch.isalnum() or ch == "_" for ch in unnamed.node)
    names = [s.name for s in plan_workers(unnamed, "cpu", 1)]
    assert names == [f"{r}-0@{unnamed.node}" for r in ("tokenizer", "prefill", "decode", "api")]


def test_tensor_parallel_sizes_per_role() -> None:
    from lmd.protocol.roles import Role
    from lmd.roles import plan_workers, rank_devices

    c = ServeConfig(Path("/r"), tp=2, decode_tp=4)
    assert [c.tp_of(r) for r in (Role.PREFILL, Role.DECODE, Role.TOKENIZER)] == [2, 4, 1]
    assert ServeConfig(Path("/r"), mode="hybrid", tp=2).tp_of(Role.HYBRID) == 2
    specs = {s.name: s.tp for s in plan_workers(c, "cuda", 1)}
    assert specs == {"tokenizer-0": 1, "prefill-0": 2, "decode-0": 4, "api-0": 1}
    assert rank_devices("cuda:2", 2) == ["cuda:2", "cuda:3"]
    assert rank_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert rank_devices("cpu", 2) == ["cpu", "cpu"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "tp: 0 is out of range"),
        ({"decode_tp": 9}, "decode_tp: 9 is out of range"),
        ({"mode": "hybrid", "prefill_tp": 2}, "prefill_tp: applies to disaggregated mode"),
        ({"tp": 2, "decode_backend": "fake"}, "decode_tp: 2 needs a model"),
        ({"mode": "hybrid", "tp": 2, "decode_backend": "fixed"}, "tp: 2 needs a model"),
    ],
)
def test_tensor_parallel_sizes_that_cannot_run_are_refused(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ServeConfig(Path("/r"), **kwargs)
