"""The tokenizer's router: least loaded among running workers, draining ones skipped,
restarts noticed by pid."""

from __future__ import annotations

import pytest

from lmd.protocol import Role
from lmd.tokenizer.routing import NoEngine, Router


def test_least_loaded_pairs_and_load_accounting() -> None:
    router = Router(Role.PREFILL, Role.DECODE, ["prefill-0", "prefill-1", "decode-0", "decode-1"])
    running = {"prefill-0": 10, "prefill-1": 11, "decode-0": 20, "decode-1": 21}
    a = router.pick(running)
    b = router.pick(running)
    assert {a.engine, b.engine} == {"prefill-0", "prefill-1"}
    assert {a.decode, b.decode} == {"decode-0", "decode-1"}
    router.prefilled(a)  # first token: a's prefill worker is free again
    assert router.load(a.engine) == 0 and router.load(a.decode) == 1
    c = router.pick(running)
    assert (c.engine == a.engine and c.decode == a.decode) or c.decode != b.decode
    for route in (a, b, c):
        router.finished(route)
        router.finished(route)  # twice is harmless
    assert all(router.load(n) == 0 for n in running)


def test_a_later_choice_follows_its_route_and_counts_there() -> None:
    """An n > 1 request's later choices go to choice 0's pair, each counted as a pick,
    with only the prompt tokens its prefill worker still has to compute."""
    router = Router(Role.PREFILL, Role.DECODE, ["prefill-0", "prefill-1", "decode-0", "decode-1"])
    running = {"prefill-0": 10, "prefill-1": 11, "decode-0": 20, "decode-1": 21}
    first = router.pick(running, num_tokens=200)
    later = router.follow(first, 8)
    assert (later.engine, later.decode) == (first.engine, first.decode)
    assert (later.engine_pid, later.decode_pid, later.num_tokens) == (
        first.engine_pid,
        first.decode_pid,
        8,
    )
    assert router.load(first.engine) == 2 and router.load(first.decode) == 2
    other = router.pick(running, num_tokens=10)  # the least loaded pair is the other one
    assert other.engine != first.engine and other.decode != first.decode
    for route in (first, later, other):
        router.finished(route)
    assert all(router.load(n) == 0 for n in running)


def test_scaled_and_draining_workers() -> None:
    router = Router(Role.PREFILL, Role.DECODE, ["prefill-0", "decode-0"])  # the configured ones
    running = {"prefill-0": 1, "decode-0": 2, "decode-1": 3}  # lmdctl scale added one
    picked = {router.pick(running).decode for _ in range(4)}
    assert picked == {"decode-0", "decode-1"}
    only = {router.pick(running, draining=["decode-1"]).decode for _ in range(4)}
    assert only == {"decode-0"}
    with pytest.raises(NoEngine, match="no decode worker is running"):
        router.pick({"prefill-0": 1}, draining=[])


def test_broken_routes() -> None:
    router = Router(Role.PREFILL, Role.DECODE, ["prefill-0", "decode-0"])
    route = router.pick({"prefill-0": 1, "decode-0": 2})
    assert router.broken(route, {"prefill-0": 1, "decode-0": 2}) is None
    assert "decode-0" in (router.broken(route, {"prefill-0": 1, "decode-0": 9}) or "")
    assert "prefill-0" in (router.broken(route, {"decode-0": 2}) or "")
    router.prefilled(route)  # after the first token the prefill worker no longer matters
    assert router.broken(route, {"decode-0": 2}) is None


def test_hybrid_routes_have_no_decode() -> None:
    router = Router(Role.HYBRID, None, ["hybrid-0"])
    assert router.pick(None).engine == "hybrid-0"  # nothing known yet: the configured one
    route = router.pick({"hybrid-0": 5})
    assert route.engine == "hybrid-0" and route.decode == ""
    router.prefilled(route)
    assert "hybrid-0" in (router.broken(route, {}) or "")  # the engine matters to the end


def test_published_load_decides() -> None:
    """Queued prompt tokens pick the prefill worker; the free share of its pool the
    decode worker."""
    router = Router(Role.PREFILL, Role.DECODE, block_size=64)
    running = {"prefill-0": 1, "prefill-1": 2, "decode-0": 3, "decode-1": 4}
    load = {
        "prefill-0": {"queued_tokens": 5000, "free_blocks": 10},
        "prefill-1": {"queued_tokens": 100, "free_blocks": 10},
        "decode-0": {"queued_tokens": 0, "free_blocks": 10, "total_blocks": 500},
        "decode-1": {"queued_tokens": 0, "free_blocks": 500, "total_blocks": 500},
    }
    route = router.pick(running, load=load, num_tokens=1000)
    assert (route.engine, route.decode) == ("prefill-1", "decode-1")
    # What this router sent counts until the worker publishes it: 6000 tokens queued
    # on prefill-1 now outweigh the 5000 published by prefill-0.
    router.pick(running, load=load, num_tokens=5000)
    assert router.pick(running, load=load, num_tokens=10).engine == "prefill-0"
    router.prefilled(route)
    router.finished(route)
    assert router.load("decode-1") == 2  # the two later requests


def test_same_host_pairs_preferred_while_they_have_room() -> None:
    router = Router(Role.PREFILL, Role.DECODE, block_size=64)
    running = {"prefill-0@a": 1, "decode-0@a": 2, "decode-0@b": 3}
    load = {"decode-0@a": {"free_blocks": 40}, "decode-0@b": {"free_blocks": 400}}
    # 10 blocks fit on a's decode worker: KV stays within host a, though b has more room.
    assert router.pick(running, load=load, num_tokens=640).decode == "decode-0@a"
    # 64 blocks do not fit there (40 free, 11 on their way): host b takes it.
    assert router.pick(running, load=load, num_tokens=4096).decode == "decode-0@b"
    # Nothing known of the load yet: the same host, with the fewest requests.
    assert Router(Role.PREFILL, Role.DECODE).pick(running, num_tokens=640).decode == "decode-0@a"


def test_a_scaled_decode_worker_with_a_smaller_pool_takes_its_part() -> None:
    """lmdctl scale decode 2: the new worker sized its pool from what the cap left (449
    blocks against 582). Routing by the most free blocks never chose it while decode-0
    had 450 free; by load (sequences per free share) it takes requests at once."""
    router = Router(Role.PREFILL, Role.DECODE, block_size=64)
    running = {"prefill-0": 1, "decode-0": 2, "decode-1": 3}
    load = {
        "decode-0": {"free_blocks": 560, "total_blocks": 582, "running": 4},
        "decode-1": {"free_blocks": 449, "total_blocks": 449, "running": 0},  # just added
    }
    picks = [router.pick(running, load=load, num_tokens=100).decode for _ in range(8)]
    # This router's requests count at once: decode-1 takes them until it runs more than
    # decode-0's 4; then decode-0 (whose published 4 may already hold this router's next
    # ones: it lags a heartbeat, so they count as the larger of the two figures).
    assert picks == ["decode-1"] * 5 + ["decode-0"] * 3
    # A pool near full weighs more than its sequence count.
    load["decode-1"] = {"free_blocks": 20, "total_blocks": 449, "running": 6}
    fresh = Router(Role.PREFILL, Role.DECODE, block_size=64)
    assert fresh.pick(running, load=load, num_tokens=100).decode == "decode-0"


def test_pressure_of_a_decode_worker() -> None:
    router = Router(Role.PREFILL, Role.DECODE, block_size=64)
    load = {
        "decode-0": {"free_blocks": 100, "total_blocks": 100, "running": 0},
        "decode-1": {"free_blocks": 25, "total_blocks": 100, "running": 3},
        "decode-2": {"free_blocks": 0, "total_blocks": 100, "running": 1},
    }
    assert router.pressure("decode-0", load) == 1.0  # idle, whatever the pool's size
    assert router.pressure("decode-1", load) == 16.0  # 4 / 0.25
    assert router.pressure("decode-2", load) == 2000.0  # full: 2 / MIN_FREE_SHARE
    assert router.pressure("decode-9", load) == 1.0  # nothing published yet: empty
    # A block or two does not decide (a heartbeat taken while a request still ran).
    assert router.pressure("d", {"d": {"free_blocks": 581, "total_blocks": 582}}) == 1.0


def test_ties_alternate_between_decode_workers() -> None:
    """One request at a time, every pool idle between them: the decode workers take turns
    (a round robin shared by the prefill and the decode choice advanced by two each
    request, and with one prefill worker always chose the same decode worker)."""
    router = Router(Role.PREFILL, Role.DECODE, block_size=64)
    running = {"prefill-0": 1, "decode-0": 2, "decode-1": 3}
    load = {
        "decode-0": {"free_blocks": 582, "total_blocks": 582, "running": 0},
        "decode-1": {"free_blocks": 233, "total_blocks": 233, "running": 0},
    }
    picks = []
    for _ in range(6):
        route = router.pick(running, load=load, num_tokens=10)
        picks.append(route.decode)
        router.prefilled(route)
        router.finished(route)
    assert picks.count("decode-0") == picks.count("decode-1") == 3
