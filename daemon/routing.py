"""Which engine workers take a request: the tokenizer's router. Pure: no I/O.

Hybrid mode routes to one of the hybrid engines; disaggregated mode to a pair (a
prefill worker, and the decode worker its KV migrates to). Among the workers that are
running, each pick takes the one with the fewest requests this router has in flight on
it (a request counts on its prefill worker until its first token arrives, and on its
decode worker until it ends), ties going round robin. The tokenizer routes every
request of the daemon, so these counts are the engines' request load.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass


class NoEngine(LookupError):
    """No running worker of a role the request needs; the message says which."""


@dataclass(slots=True)
class Route:
    engine: str  # receives Generate: a hybrid or prefill worker
    decode: str  # disaggregated: the decode worker; "" in hybrid mode
    engine_pid: int | None  # the processes picked, to notice a restart
    decode_pid: int | None
    prefilled: bool = False  # the first token arrived: the engine is done with it
    done: bool = False


class Router:
    def __init__(self, engines: list[str], decodes: list[str]) -> None:
        if not engines:
            raise ValueError("no engine workers to route to")
        self.engines = engines
        self.decodes = decodes
        self._load: Counter[str] = Counter()
        self._turn = itertools.count()

    def pick(self, running: dict[str, int] | None, draining: Collection[str] = ()) -> Route:
        """A route over running workers (`running`: name -> pid; None = assume the
        configured ones run), leaving out `draining` ones (being retired)."""
        engine = self._least_loaded(self._names(self.engines, running, draining), running)
        decode = ""
        if self.decodes:
            decode = self._least_loaded(self._names(self.decodes, running, draining), running)
        route = Route(
            engine,
            decode,
            None if running is None else running[engine],
            None if running is None or not decode else running[decode],
        )
        self._load[engine] += 1
        if decode:
            self._load[decode] += 1
        return route

    def prefilled(self, route: Route) -> None:
        """The request's first token arrived: its prefill worker is done with it."""
        if route.decode and not route.prefilled and not route.done:
            self._load[route.engine] -= 1
        route.prefilled = True

    def finished(self, route: Route) -> None:
        """The request ended (finished, failed or aborted); a second call does nothing."""
        if route.done:
            return
        if route.decode:
            if not route.prefilled:
                self._load[route.engine] -= 1
            self._load[route.decode] -= 1
        else:
            self._load[route.engine] -= 1
        route.done = True

    def broken(self, route: Route, running: dict[str, int]) -> str | None:
        """Why `route` cannot complete with the workers now running, or None."""
        for name, pid, needed in (
            (route.engine, route.engine_pid, not route.prefilled or not route.decode),
            (route.decode, route.decode_pid, bool(route.decode)),
        ):
            if needed and name and running.get(name) != pid:
                return f"{name}, serving this request, restarted"
        return None

    def load(self, name: str) -> int:
        return self._load[name]

    @staticmethod
    def _names(
        configured: list[str], running: dict[str, int] | None, draining: Collection[str]
    ) -> list[str]:
        """Workers of the role of `configured`: those running (lmdctl scale adds and
        removes some), in index order, or the configured ones when nothing is known."""
        if running is None:
            return configured
        role = configured[0].rsplit("-", 1)[0]
        names = [n for n in running if n.rsplit("-", 1)[0] == role and n not in draining]
        if not names:
            raise NoEngine(f"no {role} worker is running")
        return sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]))

    def _least_loaded(self, up: list[str], running: dict[str, int] | None) -> str:
        start = next(self._turn) % len(up)
        rotated = up[start:] + up[:start]
        return min(rotated, key=lambda n: self._load[n])
