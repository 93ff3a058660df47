"""The cluster a node's workers see (lmd.cluster.view): its own workers merged with the
other nodes' records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmd.cluster.view import merge, worker_facts


@dataclass
class FakeChild:
    name: str
    role: str
    pid: int | None
    state: str = "running"
    retiring: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Record:
    node: str
    state: str
    workers: dict[str, dict[str, Any]]


def test_worker_facts_carry_endpoint_load_and_retiring() -> None:
    facts = worker_facts(
        [
            FakeChild(
                "prefill-0@a",
                "prefill",
                11,
                info={"endpoint": "tcp://10.0.0.2:4000", "device": "cuda:0"},
                stats={"kv": {"free_blocks": 7, "total_blocks": 9}, "queued_tokens": 300},
            ),
            FakeChild("decode-1@a", "decode", 12, retiring=True),  # no heartbeat yet
            FakeChild("api-0@a", "api", None, state="restarting"),
        ]
    )
    assert facts["prefill-0@a"] == {
        "role": "prefill",
        "pid": 11,
        "state": "running",
        "endpoint": "tcp://10.0.0.2:4000",
        "device": "cuda:0",
        "load": {"queued_tokens": 300, "free_blocks": 7, "total_blocks": 9, "running": 0},
        "total_blocks": 9,
    }
    assert facts["decode-1@a"] == {
        "role": "decode",
        "pid": 12,
        "state": "running",
        "retiring": True,
    }
    assert facts["api-0@a"]["state"] == "restarting"


def test_merge_routes_to_running_workers_everywhere_but_closed_nodes() -> None:
    own = {
        "api-0@a": {"role": "api", "pid": 1, "state": "running", "endpoint": "tcp://a:1"},
        "prefill-0@a": {"role": "prefill", "pid": 2, "state": "restarting"},
    }
    others = [
        Record("a", "running", {"ghost-0@a": {"pid": 9, "state": "running"}}),  # our echo
        Record(
            "b",
            "running",
            {
                "decode-0@b": {
                    "pid": 5,
                    "state": "running",
                    "endpoint": "tcp://b:2",
                    "load": {"queued_tokens": 0, "free_blocks": 40},
                },
                "decode-1@b": {"pid": 6, "state": "running"},  # no endpoint: unreachable
            },
        ),
        Record(
            "c", "draining", {"decode-0@c": {"pid": 7, "state": "running", "endpoint": "tcp://c:3"}}
        ),
    ]
    view = merge("a", "running", own, others)
    assert view.workers == {"api-0@a": 1, "decode-0@b": 5, "decode-0@c": 7}
    assert view.endpoints == {"decode-0@b": "tcp://b:2", "decode-0@c": "tcp://c:3"}
    assert view.draining == ["decode-0@c"]  # its node drains: nothing new goes there
    assert view.load == {"decode-0@b": {"queued_tokens": 0, "free_blocks": 40}}
    assert view.missing(["api", "tokenizer", "prefill", "decode"]) == ["tokenizer", "prefill"]


def test_a_single_host_view_is_its_running_workers() -> None:
    facts = worker_facts([FakeChild("prefill-0", "prefill", 3), FakeChild("decode-0", "decode", 4)])
    view = merge("", "draining", facts)
    assert view.workers == {"prefill-0": 3, "decode-0": 4}
    assert view.endpoints == {} and view.draining == []  # its own drain: workers refuse
