"""Which engine workers take a request: the tokenizer's router. Pure: no I/O.

Hybrid mode routes to one of the hybrid engines; disaggregated mode to a pair (a
prefill worker, and the decode worker its KV migrates to). Only running workers that
are not being retired are candidates. What decides, in order:
- prefill: the fewest prompt tokens queued, counting both what the worker last
  published (`queued_tokens`, with its heartbeat, through the supervisor; in a cluster,
  other routers' requests too) and what this router sent it that has not prefilled yet
  (the published figure lags a heartbeat); then the fewest requests from this router.
- decode: a worker on the prefill worker's node if one has room for the prompt (its
  published `free_blocks` less the blocks this router's requests on their way to it
  will take): KV then moves within a host. Among the candidates, the least load
  (`pressure`): its sequences (published `running`, or this router's requests on it if
  more: the published figure lags a heartbeat), plus the one to place, per free share
  of its pool. Pools of different sizes compare by their free share, not by their free
  blocks, so a worker that `lmdctl scale` adds, with a pool smaller than the others'
  (sized from what the cap left), takes its part of the requests at once. Then the
  fewest requests from this router.
Ties go round robin. Before any load is published, every worker has the same figures
and the router's own request counts decide.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from lmd.names import index_of, node_of, role_of
from lmd.protocol.roles import Role

# A decode pool's free share counts in steps of 1/SHARE_STEPS (rounded up): pools that
# differ by a block or two are alike, and their sequences decide. A full pool counts as
# MIN_FREE_SHARE (for the division): full pools then compare by their sequences.
SHARE_STEPS = 32
MIN_FREE_SHARE = 1e-3


class NoEngine(LookupError):
    """No running worker of a role the request needs; the message says which."""


@dataclass(slots=True)
class Route:
    engine: str  # receives Generate: a hybrid or prefill worker
    decode: str  # disaggregated: the decode worker; "" in hybrid mode
    engine_pid: int | None  # the processes picked, to notice a restart
    decode_pid: int | None
    num_tokens: int = 0  # prompt tokens, counted on both workers until prefilled
    prefilled: bool = False  # the first token arrived: the engine is done with it
    done: bool = False


class Router:
    def __init__(
        self,
        engine_role: Role,
        decode_role: Role | None = None,
        configured: Collection[str] = (),
        block_size: int = 64,
    ) -> None:
        self.engine_role = engine_role  # hybrid or prefill
        self.decode_role = decode_role  # decode, or None in hybrid mode
        self.configured = sorted(configured)  # this node's: used until the running are known
        self.block_size = block_size
        self._load: Counter[str] = Counter()  # requests of this router on each worker
        self._tokens: Counter[str] = Counter()  # their prompt tokens not yet prefilled
        # Where each role's round robin starts next: one turn per role, so that a pick's
        # two choices do not advance each other's (with one prefill worker, a shared turn
        # moved by two each request and always broke ties to the same decode worker).
        self._turns: Counter[str] = Counter()

    def pick(
        self,
        running: dict[str, int] | None,
        draining: Collection[str] = (),
        load: Mapping[str, Mapping[str, int]] | None = None,
        num_tokens: int = 0,
    ) -> Route:
        """A route over running workers (`running`: name -> pid; None = assume the
        configured ones run), leaving out `draining` ones (being retired); `load` is
        what the engines published, `num_tokens` the prompt's length."""
        load = load or {}
        engines = self._names(self.engine_role, running, draining)
        engine = self._best(engines, lambda n: (self._queued(n, load), self._load[n]))
        decode = ""
        if self.decode_role:
            decodes = self._names(self.decode_role, running, draining)
            need = -(-num_tokens // self.block_size) + 1
            near = [
                d for d in decodes if node_of(d) == node_of(engine) and self._fits(d, need, load)
            ]
            decode = self._best(near or decodes, lambda n: (self.pressure(n, load), self._load[n]))
        route = Route(
            engine,
            decode,
            None if running is None else running[engine],
            None if running is None or not decode else running[decode],
            num_tokens,
        )
        self._count(route)
        return route

    def follow(self, route: Route, num_tokens: int) -> Route:
        """Another request on `route`'s workers, counted as a pick is: a later choice of
        the same prompt (tokenizer/choices.py), of which its engine has to compute only
        `num_tokens` (the prompt's full blocks are cached by then)."""
        again = Route(route.engine, route.decode, route.engine_pid, route.decode_pid, num_tokens)
        self._count(again)
        return again

    def _count(self, route: Route) -> None:
        for name in (route.engine, route.decode):
            if name:
                self._load[name] += 1
                self._tokens[name] += route.num_tokens

    def prefilled(self, route: Route) -> None:
        """The request's first token arrived: its prefill worker is done with it."""
        if not route.prefilled and not route.done:
            self._settle(route, load=bool(route.decode))
        route.prefilled = True

    def finished(self, route: Route) -> None:
        """The request ended (finished, failed or aborted); a second call does nothing."""
        if route.done:
            return
        if not route.prefilled:
            self._settle(route, load=bool(route.decode))
        self._load[route.decode or route.engine] -= 1
        route.done = True

    def broken(self, route: Route, running: dict[str, int]) -> str | None:
        """Why `route` cannot complete with the workers now running, or None."""
        for name, pid, needed in (
            (route.engine, route.engine_pid, not route.prefilled or not route.decode),
            (route.decode, route.decode_pid, bool(route.decode)),
        ):
            if needed and name and running.get(name) != pid:
                return f"{name}, serving this request, restarted or left"
        return None

    def load(self, name: str) -> int:
        return self._load[name]

    def pressure(self, name: str, load: Mapping[str, Mapping[str, int]]) -> float:
        """A decode worker's load: (its sequences + 1) / the free share of its pool
        (in 1/SHARE_STEPS steps).

        Lower is better. Idle, any pool scores 1; each sequence adds 1, scaled up as
        the pool fills. A worker that published nothing yet (just added) counts as an
        empty pool with this router's requests on it."""
        published = load.get(name, {})
        seqs = max(published.get("running", 0), self._load[name])
        total = published.get("total_blocks", 0)
        share = 1.0
        if total > 0 and "free_blocks" in published:
            room = max(0, self._room(name, load))
            share = math.ceil(room * SHARE_STEPS / total) / SHARE_STEPS
        return (seqs + 1) / max(share, MIN_FREE_SHARE)

    def _settle(self, route: Route, load: bool) -> None:
        """The prompt is computed: its tokens no longer count; in disaggregated mode,
        the request no longer counts on its prefill worker (`load`)."""
        for name in (route.engine, route.decode):
            if name:
                self._tokens[name] -= route.num_tokens
        if load:
            self._load[route.engine] -= 1

    def _queued(self, name: str, load: Mapping[str, Mapping[str, int]]) -> int:
        return max(load.get(name, {}).get("queued_tokens", 0), self._tokens[name])

    def _room(self, name: str, load: Mapping[str, Mapping[str, int]]) -> int:
        """Free blocks left once this router's requests on their way there arrive;
        0 when nothing is published yet (all workers alike)."""
        published = load.get(name, {}).get("free_blocks")
        if published is None:
            return 0
        return published - -(-self._tokens[name] // self.block_size)

    def _fits(self, name: str, need: int, load: Mapping[str, Mapping[str, int]]) -> bool:
        """Room for `need` blocks, as far as is known (nothing published: yes)."""
        return "free_blocks" not in load.get(name, {}) or self._room(name, load) >= need

    def _best(self, names: list[str], key: Callable[[str], tuple[float, int]]) -> str:
        role = role_of(names[0])
        start = self._turns[role] % len(names)
        self._turns[role] += 1
        rotated = names[start:] + names[:start]
        return min(rotated, key=key)

    def _names(
        self, role: str, running: dict[str, int] | None, draining: Collection[str]
    ) -> list[str]:
        """Workers of `role`: those running (lmdctl scale adds and removes some; a
        cluster's other nodes have theirs), or the configured ones when nothing is
        known yet."""
        pool = self.configured if running is None else running
        names = [n for n in pool if role_of(n) == role and n not in draining]
        if not names:
            raise NoEngine(f"no {role} worker is running")
        return sorted(names, key=lambda n: (node_of(n), index_of(n)))
