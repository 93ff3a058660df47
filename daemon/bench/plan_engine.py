"""One simulated engine worker for `lmd-bench plan` (plan_sim.py joins them into a cluster).

An `Engine` steps as lmd's engine does (engine/engine.py): when prompts are queued and its
role prefills, a prefill step packs them up to max_prefill_tokens (the last one chunked to
fit); otherwise, when sequences run, decode steps; otherwise it idles until work comes.

Decode steps run in stretches: between two changes of the batch every step is known (a
step of b sequences takes the profile's time at b, plus reading the KV past context_len,
and each step adds b tokens of context), so k steps are one event; work that arrives
mid-stretch cuts it at the next step boundary. Events are O(requests), not O(tokens).

`Slots` is a worker's batch slots and KV, reserved in arrival order (decode-first).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lmd.bench.plan_profile import WorkerProfile
from lmd.bench.plan_workload import SimRequest


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()  # equal times run in the order they were set

    def at(self, time: float, action: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (time, next(self._order), action, args))

    def run(self) -> None:
        while self._events:
            self.now, _, action, args = heapq.heappop(self._events)
            action(*args)


class Slots:
    """One worker's batch slots and KV tokens, granted in arrival order."""

    def __init__(self, max_seqs: int, kv_tokens: int | None, grant: Callable[[int], None]) -> None:
        self.max_seqs, self.kv_tokens, self.grant = max_seqs, kv_tokens, grant
        self.num_seqs = self.kv_used = self.num_waited = 0
        self.waiting: deque[tuple[int, int]] = deque()  # (request, tokens)

    def ask(self, rid: int, tokens: int) -> None:
        self.waiting.append((rid, tokens))
        self._grant()
        self.num_waited += bool(self.waiting)

    def release(self, tokens: int) -> None:
        self.num_seqs -= 1
        self.kv_used -= tokens
        self._grant()

    def _grant(self) -> None:
        while self.waiting and self.num_seqs < self.max_seqs:
            rid, tokens = self.waiting[0]
            if self.kv_tokens is not None and self.kv_used + tokens > self.kv_tokens:
                return
            self.waiting.popleft()
            self.num_seqs += 1
            self.kv_used += tokens
            self.grant(rid)


class Engine:
    """One worker: prefill steps and/or decode stretches, as its role allows."""

    def __init__(
        self, clock: Clock, profile: WorkerProfile, requests: Sequence[SimRequest],
        *, prefills: bool, on_prefilled: Callable[[int], None],
        on_finished: Callable[[int], None],
    ) -> None:  # fmt: skip
        self.clock, self.profile, self.requests = clock, profile, requests
        self.prefills, self.on_prefilled, self.on_finished = prefills, on_prefilled, on_finished
        self.queue: deque[list[int]] = deque()  # [request, prompt tokens left]
        self.joining: list[int] = []  # prefilled, joining the batch at the next boundary
        self.running: list[tuple[int, int, int]] = []  # heap of (last step, request, KV)
        self.steps = 0  # decode steps run so far
        self.context = 0  # KV tokens the running batch reads per step
        self.busy = self._in_stretch = False
        self._version = 0  # of the pending stretch end; a cut stretch's old end is stale
        self._start, self._stretch = 0.0, 0
        self.prefill_s = self.decode_s = self.batch_s = 0.0  # batch_s: batch size x seconds

    def enqueue(self, rid: int) -> None:
        self.queue.append([rid, self.requests[rid].input_len])
        self.clock.at(self.clock.now, self._wake)

    def join(self, rid: int) -> None:
        self.joining.append(rid)
        self.clock.at(self.clock.now, self._wake)

    def _wake(self) -> None:
        if not self.busy:
            self._boundary()
        elif self._in_stretch and (self.joining or (self.prefills and self.queue)):
            self._cut()

    def _boundary(self) -> None:
        """Between two steps: finish, take in the joining, start the next step(s)."""
        while self.running and self.running[0][0] <= self.steps:
            _, rid, kv = heapq.heappop(self.running)
            self.context -= kv
            self.on_finished(rid)
        for rid in self.joining:
            r = self.requests[rid]
            last = self.steps + r.output_len - 1
            heapq.heappush(self.running, (last, rid, r.input_len + r.output_len))
            self.context += r.input_len + 1
        self.joining.clear()
        self.busy = True
        if self.prefills and self.queue:
            tokens, done = self._pack()
            seconds = self.profile.prefill_step_ms(tokens) / 1e3
            self.prefill_s += seconds
            self.clock.at(self.clock.now + seconds, self._prefilled, done)
        elif self.running:
            self._in_stretch = True
            self._start, self._stretch = self.clock.now, self.running[0][0] - self.steps
            self._schedule_end()
        else:
            self.busy = False

    def _pack(self) -> tuple[int, list[int]]:
        """Queued prompts up to max_prefill_tokens, the last one chunked to fit."""
        budget, tokens, done = self.profile.max_prefill_tokens, 0, []
        while self.queue and tokens < budget:
            head = self.queue[0]
            take = min(head[1], budget - tokens)
            head[1] -= take
            tokens += take
            if head[1] == 0:
                done.append(self.queue.popleft()[0])
        return tokens, done

    def _prefilled(self, done: list[int]) -> None:
        for rid in done:
            self.on_prefilled(rid)
        self._boundary()

    def _stretch_s(self, k: int) -> float:
        """Seconds of the next k decode steps with this batch (context grows by b a step)."""
        b = len(self.running)
        first = self.profile.decode_step_ms(b, self.context)
        grow = self.profile.ms_per_context_token * b
        return (k * first + grow * k * (k - 1) / 2) / 1e3

    def _schedule_end(self) -> None:
        self._version += 1
        end = self._start + self._stretch_s(self._stretch)
        self.clock.at(end, self._stretched, self._version)

    def _cut(self) -> None:
        """Work arrived mid-stretch: end it at the first step boundary from now."""
        elapsed, low, high = self.clock.now - self._start, 1, self._stretch
        while low < high:
            mid = (low + high) // 2
            if self._stretch_s(mid) >= elapsed:
                high = mid
            else:
                low = mid + 1
        if low < self._stretch:
            self._stretch = low
            self._schedule_end()

    def _stretched(self, version: int) -> None:
        if version != self._version:
            return
        seconds, b = self.clock.now - self._start, len(self.running)
        self.decode_s += seconds
        self.batch_s += b * seconds
        self.steps += self._stretch
        self.context += self._stretch * b
        self._in_stretch = False
        self._boundary()
