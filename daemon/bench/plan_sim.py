"""A discrete-event simulation of an lmd cluster for `lmd-bench plan` (pure, deterministic).

Life cycle of a request in the simulation (disaggregated; hybrid skips steps 2 and 5):
  1. It arrives; the tokenizer's router (lmd.tokenizer.routing.Router itself) picks the prefill and
     the decode worker with the fewest requests in flight, ties round robin.
  2. The prefill worker asks the decode worker to reserve, in arrival order, while what
     it reserved and has not prefilled yet is under two steps of prompt tokens. Decode
     reserves KV for the whole sequence (prompt + output, so it is never preempted) and a
     batch slot, in the order asked; the prompt waits for that (lmd's decode-first
     back-pressure: no reservation, no prefill), then joins the prefill queue.
  3. Each prefill step packs queued prompts up to max_prefill_tokens, chunking the one
     that does not fit; its time is the profile's for that many tokens.
  4. The step that completes the prompt samples the first token.
  5. The KV crosses the prefill worker's link (one transfer at a time: bytes / gbps; the
     copy overlaps the next prefill step), then the fixed migration latency: the first
     token reaches the client (TTFT) and the sequence joins the decode worker.
  6. The decode worker takes it into its batch at its next step boundary; a step of b
     sequences takes the profile's time at b (plus reading the KV past context_len); the
     step that makes the last token ends the request.
Hybrid: one engine per GPU does both, as lmd's engine does: a prefill step whenever
prompts wait (they interrupt decoding), else a decode step; the first token is the TTFT and
the sequence joins the batch at once.

The engines themselves (prefill steps, decode stretches) are plan_engine.py's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lmd.bench.plan_engine import Clock, Engine, Slots
from lmd.bench.plan_profile import WorkerProfile
from lmd.bench.plan_workload import SimRequest
from lmd.names import worker_name
from lmd.protocol.roles import Role
from lmd.tokenizer.routing import Route, Router

RESERVE_AHEAD_STEPS = 2  # lmd.prefill.worker's (a test keeps them equal)


@dataclass(slots=True)
class SimResult:
    """Per request (index = the request's), seconds from the window's start."""

    first_token: list[float]
    end: list[float]
    utilisation: dict[str, float] = field(default_factory=dict)
    num_waited: int = 0  # requests whose KV reservation was not granted on arrival


class _Cluster:
    """Workers joined by the router; hybrid when num_decode == 0."""

    def __init__(
        self, profile: WorkerProfile, requests: Sequence[SimRequest], num_prefill: int,
        num_decode: int,
    ) -> None:  # fmt: skip
        self.profile, self.requests, self.clock = profile, requests, Clock()
        self.first = [math.nan] * len(requests)
        self.end = [math.nan] * len(requests)
        self.routes: list[Route | None] = [None] * len(requests)
        role, decode = (Role.PREFILL, Role.DECODE) if num_decode else (Role.HYBRID, None)
        names = [worker_name(role, i) for i in range(num_prefill)]
        decodes = [worker_name(Role.DECODE, i) for i in range(num_decode)]
        self.router = Router(role, decode, names + decodes)
        self.index = {n: i for i, n in enumerate(names)} | {n: i for i, n in enumerate(decodes)}
        on_prefilled = self._migrate if num_decode else self._first_token
        self.prefillers = [self._engine(True, on_prefilled) for _ in names]
        self.decoders = [self._engine(False, self._migrate) for _ in decodes]
        holders = len(decodes) or len(names)  # who holds a sequence's KV while it decodes
        self.slots = [
            Slots(profile.max_batch, profile.kv_capacity_tokens, self._granted)
            for _ in range(holders)
        ]
        self.link_free = [0.0] * len(names)
        self.link_s = 0.0
        # Per prefill worker: requests not yet reserved, and [count, prompt tokens] of those
        # reserved but not yet prefilled.
        self.unreserved: list[deque[int]] = [deque() for _ in names]
        self.ahead = [[0, 0] for _ in names]

    def _engine(self, prefills: bool, on_prefilled: Callable[[int], None]) -> Engine:
        return Engine(self.clock, self.profile, self.requests, prefills=prefills,
                       on_prefilled=on_prefilled, on_finished=self._finished)  # fmt: skip

    def route(self, rid: int) -> Route:
        route = self.routes[rid]
        assert route is not None  # set on arrival, before anything else happens to it
        return route

    def run(self) -> SimResult:
        for rid, r in enumerate(self.requests):
            self.clock.at(r.arrival, self._arrive, rid)
        self.clock.run()
        waited = sum(s.num_waited for s in self.slots)
        return SimResult(self.first, self.end, self._utilisation(), waited)

    def _arrive(self, rid: int) -> None:
        tokens = self.requests[rid].input_len
        route = self.routes[rid] = self.router.pick(None, num_tokens=tokens)
        if route.decode:
            self.unreserved[self.index[route.engine]].append(rid)
            self._reserve(self.index[route.engine])
        else:  # hybrid: the engine admits it when its batch and KV have room
            r = self.requests[rid]
            self.slots[self.index[route.engine]].ask(rid, r.input_len + r.output_len)

    def _reserve(self, prefill: int) -> None:
        """Reserve decode KV for queued prompts while less than RESERVE_AHEAD_STEPS full
        steps of prompt tokens are reserved and not yet prefilled (as lmd.prefill.worker)."""
        waiting, ahead = self.unreserved[prefill], self.ahead[prefill]
        budget = RESERVE_AHEAD_STEPS * self.profile.max_prefill_tokens
        while waiting and ahead[0] < self.profile.max_batch and (not ahead[0] or ahead[1] < budget):
            rid = waiting.popleft()
            r = self.requests[rid]
            ahead[0] += 1
            ahead[1] += r.input_len
            self.slots[self.index[self.route(rid).decode]].ask(rid, r.input_len + r.output_len)

    def _granted(self, rid: int) -> None:
        self.prefillers[self.index[self.route(rid).engine]].enqueue(rid)

    def _first_token(self, rid: int) -> None:
        """Hybrid: the first token is out; the sequence joins the engine's own batch."""
        self.first[rid] = self.clock.now
        route = self.route(rid)
        if self.requests[rid].output_len == 1:
            self._finished(rid)
        else:
            self.prefillers[self.index[route.engine]].joining.append(rid)

    def _migrate(self, rid: int) -> None:
        r, route, now = self.requests[rid], self.route(rid), self.clock.now
        link = self.index[route.engine]
        self.ahead[link][0] -= 1
        self.ahead[link][1] -= r.input_len
        self._reserve(link)
        if r.output_len == 1:  # lmd sends it straight to the tokenizer; nothing migrates
            self.first[rid] = now
            self._finished(rid)
            return
        start = max(now, self.link_free[link])
        seconds = self.profile.migration_s(r.input_len)
        self.link_free[link] = start + seconds
        self.link_s += seconds
        latency = self.profile.migration_latency_ms / 1e3
        self.clock.at(start + seconds + latency, self._migrated, rid)

    def _migrated(self, rid: int) -> None:
        self.first[rid] = self.clock.now
        route = self.route(rid)
        self.router.prefilled(route)
        self.decoders[self.index[route.decode]].join(rid)

    def _finished(self, rid: int) -> None:
        self.end[rid] = self.clock.now
        route, r = self.route(rid), self.requests[rid]
        self.router.finished(route)
        self.slots[self.index[route.decode or route.engine]].release(r.input_len + r.output_len)

    def _utilisation(self) -> dict[str, float]:
        """Busy fractions from time 0 to the last request's end; the decode batch's mean."""
        span = max(self.end, default=0.0) or 1.0
        workers = self.decoders or self.prefillers
        decode_s = sum(e.decode_s for e in workers)
        return {
            "prefill_busy": sum(e.prefill_s for e in self.prefillers) / len(self.prefillers) / span,
            "decode_busy": decode_s / len(workers) / span,
            "link_busy": self.link_s / len(self.prefillers) / span if self.decoders else 0.0,
            "decode_batch_mean": sum(e.batch_s for e in workers) / decode_s if decode_s else 0.0,
        }


def _check(profile: WorkerProfile, requests: Sequence[SimRequest]) -> None:
    capacity = profile.kv_capacity_tokens
    for i, r in enumerate(requests):
        if capacity is not None and r.input_len + r.output_len > capacity:
            raise ValueError(
                f"request {i} needs {r.input_len + r.output_len:,} tokens of KV, more than "
                f"the profile's kv_capacity_tokens ({capacity:,}): shorten the lengths"
            )


def simulate_disaggregated(
    profile: WorkerProfile, requests: Sequence[SimRequest], num_prefill: int, num_decode: int
) -> SimResult:
    """`num_prefill` prefill and `num_decode` decode workers, one GPU each."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError("disaggregated needs at least one prefill and one decode worker")
    _check(profile, requests)
    return _Cluster(profile, requests, num_prefill, num_decode).run()


def simulate_hybrid(
    profile: WorkerProfile, requests: Sequence[SimRequest], num_workers: int
) -> SimResult:
    """`num_workers` hybrid engines (prefill and decode in one), one GPU each."""
    if num_workers < 1:
        raise ValueError("hybrid needs at least one worker")
    _check(profile, requests)
    return _Cluster(profile, requests, num_workers, 0).run()
