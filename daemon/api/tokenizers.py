"""Which tokenizer worker an api worker hands a request to (`--tokenizer-workers`).

Requests go to the running tokenizers of this node in turn (a cluster node without
one: to the cluster's running tokenizers), so that rendering, tokenizing and
detokenizing spread over several processes. An interactive session's turns all go to
one tokenizer, by its id among the configured ones: the session's history lives there
(tokenizer/sessions.py); while that one restarts, its turns fail with 503 like any
request to a stopped tokenizer, and a new session starts there afresh.
"""

from __future__ import annotations

from lmd.config import ServeConfig
from lmd.names import role_of
from lmd.protocol import Role
from lmd.roles import worker_names


class TokenizerChoice:
    def __init__(self, config: ServeConfig) -> None:
        self.configured = worker_names(config, Role.TOKENIZER)  # this node's
        self._running = list(self.configured)
        self._turn = -1

    def update(self, workers: dict[str, int]) -> None:
        """The running workers changed (ClusterState)."""
        local = [n for n in self.configured if n in workers]
        cluster = sorted(n for n in workers if role_of(n) == Role.TOKENIZER)
        self._running = local or cluster or list(self.configured)

    def pick(self, session_id: int | None = None) -> str:
        """The tokenizer for a new request (or a turn of session `session_id`)."""
        if session_id is not None:
            stable = self.configured or self._running
            return stable[session_id % len(stable)]
        self._turn = (self._turn + 1) % len(self._running)
        return self._running[self._turn]
