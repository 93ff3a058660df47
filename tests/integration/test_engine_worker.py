"""The hybrid engine worker inside a real daemon, driven over its ZeroMQ inbox as the
tokenizer drives it: Generate in, Tokens out, exact against transformers."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lmd import protocol
from tests.integration.daemon import Daemon, served, wait_until
from tests.integration.engine_client import Client
from tests.models import hf_greedy, load_reference, random_prompts, save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny Llama plus a tokenizer: every daemon runs a tokenizer process."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return path


@pytest.fixture
def hybrid(model_dir: Path) -> Iterator[Daemon]:
    yield from served(
        Daemon(
            str(model_dir),
            "--mode",
            "hybrid",
            "--block-size",
            "16",
            "--cache-max-entry-count",
            "64",
            "--heartbeat-timeout",
            "5",
        )
    )


def kv_idle(daemon: Daemon) -> bool:
    w = daemon.worker("hybrid-0")
    kv = w.get("kv")
    return bool(kv and kv["free_blocks"] == kv["total_blocks"] and w["running"] == 0)


def test_status_shows_the_engine(hybrid: Daemon) -> None:
    workers = {w["name"]: w for w in hybrid.status()["workers"]}
    assert list(workers) == ["tokenizer-0", "hybrid-0", "api-0"]
    engine = workers["hybrid-0"]
    assert engine["role"] == "hybrid" and engine["backend"] == "torch"
    assert engine["device"] == "cpu" and engine["dtype"] == "float32"
    wait_until(lambda: "kv" in hybrid.worker("hybrid-0"), 10, "engine stats")
    kv = hybrid.worker("hybrid-0")["kv"]
    assert kv == {"total_blocks": 64, "free_blocks": 64, "block_size": 16}


def test_greedy_tokens_equal_transformers(hybrid: Daemon, model_dir: Path) -> None:
    prompts = random_prompts([5, 40, 77], seed=11)
    client = Client(hybrid)
    try:
        for i, prompt in enumerate(prompts):
            client.generate(f"r{i}", prompt, temperature=0.0, max_tokens=16, ignore_eos=True)
        out = client.collect({f"r{i}" for i in range(len(prompts))})
    finally:
        client.close()
    reference = load_reference(model_dir)
    for i, prompt in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(reference, prompt, 16)
    wait_until(lambda: kv_idle(hybrid), 10, "every block free again")


def test_bad_requests_get_an_error_and_nothing_leaks(hybrid: Daemon) -> None:
    client = Client(hybrid)
    try:
        client.generate("bad", [5, 6], temperature=-1.0)
        err = client.recv()
        assert isinstance(err, protocol.RequestError) and err.request_id == "bad"
        assert err.code == "invalid_request_error" and "temperature" in err.message
        client.generate("long", [5, 6] * 550, max_tokens=4)  # ids in the vocabulary
        err = client.recv()
        assert isinstance(err, protocol.RequestError) and "limit" in err.message
        client.generate("slow", [5, 6, 7], temperature=0.0, max_tokens=500, ignore_eos=True)
        first = client.recv()
        assert isinstance(first, protocol.Tokens) and first.request_ids == ["slow"]
        client.abort("slow")
        wait_until(lambda: kv_idle(hybrid), 10, "aborted request's blocks freed")
    finally:
        client.close()
    assert hybrid.worker("hybrid-0")["inflight"] == 0


def test_engine_killed_comes_back_and_serves(hybrid: Daemon) -> None:
    old = hybrid.worker("hybrid-0")["pid"]
    os.kill(old, signal.SIGKILL)
    wait_until(
        lambda: (
            hybrid.worker("hybrid-0")["pid"] not in (None, old)
            and hybrid.worker("hybrid-0")["state"] == "running"
        ),
        60,
        "engine restart",
    )
    client = Client(hybrid)
    try:
        client.generate("again", [9, 8, 7], temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(client.collect({"again"})["again"]) == 4
    finally:
        client.close()
    assert hybrid.worker("hybrid-0")["restarts"] == 1


def test_token_ids_outside_the_vocabulary_fail_that_request_alone(
    hybrid: Daemon, model_dir: Path
) -> None:
    """A Generate whose prompt holds an id >= the vocabulary size used to reach the model
    (IndexError in the embedding), fail the step and restart the worker, taking every
    request with it. Now that request alone gets an error; the others go on."""
    vocab = load_reference(model_dir).config.vocab_size
    client = Client(hybrid)
    try:
        client.generate("long", [5, 6, 7], temperature=0.0, max_tokens=40, ignore_eos=True)
        first = client.recv()
        assert isinstance(first, protocol.Tokens) and first.request_ids == ["long"]
        client.generate("oov", [5, vocab, 7], temperature=0.0, max_tokens=4)
        client.generate("stop", [5, 6], stop_token_ids=[vocab + 3], min_new_tokens=2)
        errors: dict[str, str] = {}
        tokens = 1
        while len(errors) < 2 or tokens < 40:
            msg = client.recv()
            if isinstance(msg, protocol.RequestError):
                assert msg.code == "invalid_request_error"
                errors[msg.request_id] = msg.message
            else:
                assert isinstance(msg, protocol.Tokens) and msg.request_ids == ["long"], msg
                tokens += 1
        assert f"prompt token id {vocab} is outside this model's vocabulary" in errors["oov"]
        assert f"stop_token_ids entry {vocab + 3} is outside" in errors["stop"]
    finally:
        client.close()
    wait_until(lambda: kv_idle(hybrid), 10, "every block free again")
    engine = hybrid.worker("hybrid-0")
    assert engine["restarts"] == 0 and engine["inflight"] == 0
