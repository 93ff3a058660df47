"""An engine worker's watch over the processes its requests answer to (hybrid/clients.py)."""

from __future__ import annotations

from lmd.hybrid.clients import Clients


def test_a_dead_or_replaced_receiver_is_reported_once() -> None:
    clients = Clients()
    workers = {"tokenizer-0": 10, "tokenizer-1": 11, "decode-0": 12}
    clients.note("tokenizer-0", workers)
    clients.note("tokenizer-1", workers)
    clients.note("client-0", workers)  # not a worker of the daemon: not watched
    assert clients.gone(workers) == []
    # tokenizer-0 killed: ClusterState no longer lists it.
    assert clients.gone({"tokenizer-1": 11, "decode-0": 12}) == [("tokenizer-0", False)]
    assert clients.gone({"tokenizer-1": 11}) == []  # reported once
    # tokenizer-1 restarted between two ClusterStates: another pid has its name.
    assert clients.gone({"tokenizer-1": 21}) == [("tokenizer-1", True)]


def test_a_new_process_is_watched_from_its_first_request() -> None:
    clients = Clients()
    clients.note("tokenizer-0", {"tokenizer-0": 10})
    clients.note("tokenizer-0", {"tokenizer-0": 99})  # a stale view does not move the pid
    assert clients.gone({"tokenizer-0": 99}) == [("tokenizer-0", True)]
    clients.note("tokenizer-0", {"tokenizer-0": 99})
    assert clients.gone({"tokenizer-0": 99}) == []
    assert clients.gone({}) == []  # no ClusterState yet: nothing is known to be gone
    assert clients.gone({"api-0": 1}) == [("tokenizer-0", False)]
