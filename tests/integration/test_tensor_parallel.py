"""Tensor parallelism in a real daemon on the CPU: engine workers as groups of two
processes joined over gloo, a tiny random Llama over SmolLM2's tokenizer.

- hybrid, --tp 2: greedy tokens equal transformers' (the whole model, float32); status
  lists the ranks;
- a rank killed with SIGKILL: its requests end with an error naming it, the group comes
  back (new processes for every rank, none left over) and serves the same tokens; rank 0
  killed takes its ranks with it;
- disaggregated, prefill --prefill-tp 2 -> decode --decode-tp 1 and 1 -> 2: the prompt's
  KV migrates between groups of different sizes, each rank moving its heads; the tokens
  still equal transformers' and no KV block stays held.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lmd import protocol
from tests.integration.daemon import Daemon, alive, lmdctl, served, wait_until
from tests.integration.engine_client import Client
from tests.models import hf_greedy, load_reference, random_prompts, save_tiny_llama

# 130 tokens: 9 blocks of 16, the last prompt in several prefill chunks.
PROMPTS = random_prompts([5, 40, 77, 130], seed=23)
NEW_TOKENS = 12
ENGINE = (
    *("--block-size", "16", "--cache-max-entry-count", "64", "--max-prefill-token-num", "64"),
    *("--cpu-matmul-dtype", "float32"),  # compared token for token (test_migration.py)
)
HEARTBEAT = ("--heartbeat-timeout", "10")
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny Llama (4 heads over 2 KV heads: one KV head per rank of 2) plus a
    tokenizer: every daemon runs a tokenizer process."""
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return save_tiny_llama(path)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    model = load_reference(model_dir)
    return [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def hybrid(model_dir: Path) -> Iterator[Daemon]:
    yield from served(
        Daemon(
            str(model_dir), "--mode", "hybrid", "--tp", "2", *ENGINE, "--heartbeat-timeout", "10"
        )
    )


def greedy(daemon: Daemon, engine: str = "hybrid-0", decode: str = "") -> list[list[int]]:
    client = Client(daemon, engine, decode)
    try:
        for i, prompt in enumerate(PROMPTS):
            client.generate(
                f"r{i}", prompt, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True
            )
        out = client.collect({f"r{i}" for i in range(len(PROMPTS))})
    finally:
        client.close()
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


def pools_free(daemon: Daemon, *names: str) -> bool:
    for name in names:
        kv = daemon.worker(name).get("kv")
        if kv is None or kv["free_blocks"] != kv["total_blocks"]:
            return False
    return True


def rank_pids(daemon: Daemon, name: str) -> list[int]:
    return [r["pid"] for r in daemon.worker(name)["ranks"]]


def test_hybrid_tp2_gives_transformers_greedy_tokens(
    hybrid: Daemon, reference: list[list[int]]
) -> None:
    assert greedy(hybrid) == reference
    wait_until(lambda: pools_free(hybrid, "hybrid-0"), 10, "every block free again")


def test_status_lists_every_rank(hybrid: Daemon) -> None:
    engine = hybrid.worker("hybrid-0")
    assert engine["tp"] == 2 and engine["backend"] == "torch"
    ranks = engine["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] == engine["pid"]
    assert all(r["device"] == "cpu" and alive(r["pid"]) for r in ranks)
    rss = wait_until(lambda: hybrid.worker("hybrid-0").get("rank_rss_bytes"), 10, "rank RSS")
    assert len(rss) == 1 and rss[0] > 50 << 20  # a process holding its shard
    text = lmdctl(hybrid, "status").stdout
    assert "tensor-parallel ranks:" in text
    assert f"hybrid-0  1/2   {ranks[1]['pid']}" in text


def test_a_killed_rank_brings_its_group_back(hybrid: Daemon, reference: list[list[int]]) -> None:
    old = rank_pids(hybrid, "hybrid-0")
    restarts = hybrid.worker("hybrid-0")["restarts"]
    client = Client(hybrid)
    try:
        client.generate("slow", [5, 6, 7], temperature=0.0, max_tokens=400, ignore_eos=True)
        first = client.recv()
        assert isinstance(first, protocol.Tokens) and first.request_ids == ["slow"]
        os.kill(old[1], signal.SIGKILL)
        while True:  # its tokens until the error
            msg = client.recv()
            if isinstance(msg, protocol.RequestError):
                break
            assert isinstance(msg, protocol.Tokens), msg
        assert msg.request_id == "slow" and msg.code == "internal_error"
        assert f"hybrid-0 rank 1 (pid {old[1]}) exited" in msg.message
    finally:
        client.close()

    def back() -> bool:
        w = hybrid.worker("hybrid-0")
        return w["state"] == "running" and w["restarts"] == restarts + 1 and "ranks" in w

    wait_until(back, 90, "the group restarted")
    new = rank_pids(hybrid, "hybrid-0")
    assert not set(new) & set(old) and all(alive(p) for p in new)
    wait_until(lambda: not any(alive(p) for p in old), 10, "the old group gone")
    assert greedy(hybrid) == reference


def test_rank_0_killed_takes_its_ranks_with_it(hybrid: Daemon) -> None:
    """Rank 0 is the worker: SIGKILLed, its ranks die with it (PR_SET_PDEATHSIG) and the
    supervisor's restart brings a whole new group."""
    old = rank_pids(hybrid, "hybrid-0")
    restarts = hybrid.worker("hybrid-0")["restarts"]
    os.kill(old[0], signal.SIGKILL)
    wait_until(lambda: not any(alive(p) for p in old), 10, "rank 1 gone with rank 0")

    def back() -> bool:
        w = hybrid.worker("hybrid-0")
        return w["state"] == "running" and w["restarts"] == restarts + 1 and "ranks" in w

    wait_until(back, 90, "the group restarted")
    assert not set(rank_pids(hybrid, "hybrid-0")) & set(old)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_kv_migrates_between_groups_of_different_sizes(
    make_daemon: type[Daemon],
    model_dir: Path,
    reference: list[list[int]],
    prefill_tp: int,
    decode_tp: int,
) -> None:
    daemon = make_daemon(
        str(model_dir),
        "--mode",
        "disaggregated",
        "--prefill-tp",
        str(prefill_tp),
        "--decode-tp",
        str(decode_tp),
        *ENGINE,
        *HEARTBEAT,
    ).start()
    assert greedy(daemon, "prefill-0", decode="decode-0") == reference

    def migrated() -> bool:  # as the next heartbeat tells
        return bool(daemon.worker("decode-0")["migration"]["received"] == len(PROMPTS))

    wait_until(migrated, 10, "every prompt's KV migrated")
    wait_until(lambda: pools_free(daemon, "prefill-0", "decode-0"), 10, "every block free")
    decodes = ["decode-0"]
    if decode_tp == 2:  # a decode worker added by scale is a group of its own
        lmdctl(daemon, "scale", "decode", "2")
        wait_until(lambda: daemon.worker("decode-1").get("ranks"), 60, "decode-1's group up")
        assert greedy(daemon, "prefill-0", decode="decode-1") == reference
        wait_until(lambda: pools_free(daemon, "decode-1"), 10, "decode-1's blocks free")
        decodes.append("decode-1")
    ranks = [p for name in ("prefill-0", *decodes) for p in rank_pids_or_none(daemon, name)]
    daemon.close()
    wait_until(lambda: not any(alive(p) for p in ranks), 10, "every rank gone with the daemon")


def rank_pids_or_none(daemon: Daemon, name: str) -> list[int]:
    return [r["pid"] for r in daemon.worker(name).get("ranks") or ()]
