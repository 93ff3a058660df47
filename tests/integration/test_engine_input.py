"""Engines check what arrives over ZeroMQ: a request with a token id outside the
vocabulary fails alone, with an error naming it, and the engines keep serving (it used to
fail the step and restart the worker, taking every request with it)."""

from __future__ import annotations

import json
from pathlib import Path

import zmq

from lmd import protocol
from tests.integration.daemon import Daemon, wait_until

# The test stands in for the daemon's tokenizer: engines answer only workers of their
# cluster, so it binds tokenizer-0's inbox, which takes the socket file over (libzmq
# replaces it); the daemon's own tokenizer gets nothing from the engines.
TOKENIZER = "tokenizer-0"
ENGINES = ["prefill-0", "decode-0"]


class Tokenizer:
    """tokenizer-0's inbox, and PUSH sockets to the daemon's engines."""

    def __init__(self, daemon: Daemon) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(f"ipc://{daemon.runtime_dir}/{TOKENIZER}.ipc")
        self.out: dict[str, zmq.Socket[bytes]] = {}
        for name in ENGINES:
            self.out[name] = sock = self.ctx.socket(zmq.PUSH)
            sock.connect(f"ipc://{daemon.runtime_dir}/{name}.ipc")

    def generate(self, request_id: str, prompt: list[int], **sampling: object) -> None:
        ids = protocol.pack_ids(prompt)
        msg = protocol.Generate(request_id, TOKENIZER, sampling, ids, "decode-0")
        self.out["prefill-0"].send_multipart(protocol.encode(msg))

    def recv(self, timeout_ms: int = 20_000) -> protocol.Message:
        if not self.inbox.poll(timeout_ms):
            raise AssertionError("no answer from the engines")
        return protocol.decode(self.inbox.recv_multipart())

    def close(self) -> None:
        for sock in (self.inbox, *self.out.values()):
            sock.close(0)
        self.ctx.term()


def test_out_of_vocabulary_ids_fail_that_request_alone(daemon: Daemon, smollm2_dir: Path) -> None:
    vocab = int(json.loads((smollm2_dir / "config.json").read_text())["vocab_size"])
    pids = {w["name"]: w["pid"] for w in daemon.status()["workers"]}
    tokenizer = Tokenizer(daemon)
    try:
        # A repetition penalty reads the logits at every prompt id: past the vocabulary,
        # the fake backend's step failed too (a real model fails at the embedding).
        tokenizer.generate("oov", [5, vocab, 6], repetition_penalty=1.2, max_tokens=4)
        # A stop token banned until min_new_tokens indexes the logits as well.
        tokenizer.generate("stop", [5, 6], stop_token_ids=[vocab + 5], min_new_tokens=2)
        errors: dict[str, str] = {}
        for _ in range(2):
            msg = tokenizer.recv()
            assert isinstance(msg, protocol.RequestError), msg
            assert msg.code == "invalid_request_error"
            errors[msg.request_id] = msg.message
        assert f"prompt token id {vocab} is outside this model's vocabulary" in errors["oov"]
        assert f"stop_token_ids entry {vocab + 5} is outside" in errors["stop"]
        # Both engines still serve: the first token from prefill, the rest from decode.
        tokenizer.generate("good", [5, 6, 7], max_tokens=4, ignore_eos=True)
        positions: list[int] = []
        while len(positions) < 4:
            msg = tokenizer.recv()
            assert isinstance(msg, protocol.Tokens) and msg.request_ids == ["good"], msg
            positions += protocol.unpack_ids(msg.positions)
        assert sorted(positions) == [0, 1, 2, 3]
        # A Reserve as prefill-0 would send it: decode refuses it (its RequestError goes
        # to prefill-0, which knows no such request and drops it).
        ids = protocol.pack_ids([vocab])
        reserve = protocol.Reserve("res", "prefill-0", TOKENIZER, {"max_tokens": 4}, ids)
        tokenizer.out["decode-0"].send_multipart(protocol.encode(reserve))
        wait_until(
            lambda: daemon.worker("decode-0")["migration"]["refused"] == 1, 10, "decode's refusal"
        )
    finally:
        tokenizer.close()
    wait_until(
        lambda: all(
            (w := daemon.worker(n))["kv"]["free_blocks"] == w["kv"]["total_blocks"]
            and w["inflight"] == 0
            for n in ENGINES
        ),
        10,
        "every KV block free",
    )
    after = daemon.status()
    assert {w["name"]: w["pid"] for w in after["workers"]} == pids
    assert all(w["restarts"] == 0 for w in after["workers"])
