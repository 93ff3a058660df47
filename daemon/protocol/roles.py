"""The roles a worker plays. Pure: names and groups, nothing else.

A role travels in worker names (`decode-0`), in `ClusterState.missing_roles` and in
status; being a `StrEnum`, a role is its plain string on the wire and in JSON.

    tokenizer  chat template, tokenize, route, detokenize (lmd.tokenizer)
    prefill    compute prompts, migrate their KV to decode (lmd.prefill)
    decode     decode migrated sequences, stream tokens (lmd.decode)
    hybrid     prefill and decode in one engine process (lmd.hybrid)
    api        the OpenAI HTTP front (lmd.api)
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    # In the order a daemon starts its workers.
    TOKENIZER = "tokenizer"
    PREFILL = "prefill"
    DECODE = "decode"
    HYBRID = "hybrid"
    API = "api"

    @property
    def is_engine(self) -> bool:
        """A role that runs an engine (a model and a KV pool)."""
        return self in ENGINE_ROLES


ENGINE_ROLES = (Role.PREFILL, Role.DECODE, Role.HYBRID)
SCALABLE_ROLES = (Role.PREFILL, Role.DECODE)  # lmdctl scale
CLUSTER_ROLES = (Role.API, Role.TOKENIZER, Role.PREFILL, Role.DECODE)  # a node's --roles
