"""The processes an engine worker's requests answer to, watched for their death. Pure.

Every request an engine holds answers to one worker, its `reply_to` (a tokenizer). When
that process dies, or a new one takes its name, nobody will read the request's tokens:
the engine worker drops those requests and frees their KV blocks at once, instead of
computing for nobody until max_tokens (as the tokenizer does for the requests of an api
worker that died).
  1. `note(name, workers)` as a request arrives: the pid ClusterState shows for its
     receiver. A name that ClusterState does not list (not announced yet, or a test's
     client) is not watched.
  2. `gone(workers)` with each new ClusterState: the receivers whose process is no
     longer the one noted, each with whether another process now has its name
     (`replaced`). They are forgotten; a new process is noted with its first request.
"""

from __future__ import annotations

from collections.abc import Mapping


class Clients:
    def __init__(self) -> None:
        self._pids: dict[str, int] = {}  # receiver name -> the pid its requests came from

    def note(self, name: str, workers: Mapping[str, int]) -> None:
        pid = workers.get(name)
        if pid is not None and name not in self._pids:
            self._pids[name] = pid

    def gone(self, workers: Mapping[str, int]) -> list[tuple[str, bool]]:
        """(name, replaced) of each noted receiver whose process is gone; forgets them.
        Nothing is gone while no worker is known (no ClusterState yet)."""
        if not workers:
            return []
        out = [(n, n in workers) for n, pid in self._pids.items() if workers.get(n) != pid]
        for name, _ in out:
            del self._pids[name]
        return out
