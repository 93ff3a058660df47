"""Disaggregated serving with KV migrating over NIXL (`lmdd serve --migration-transport
nixl`), UCX choosing its transports as in production (no UCX_TLS):

- greedy and seeded SmolLM2 outputs equal the hybrid engine's, token for token, with
  every migration counted and no KV block left held;
- kill -9 of the decode worker during migrations: the affected requests end with an
  error, prefill opens the new decode worker's pool (a new NIXL agent) and serves on.
Skipped where NIXL is not installed (`pip install lmd[cluster]`).
"""

from __future__ import annotations

import pytest

from lmd.migration import nixl
from tests.integration.daemon import DISAGGREGATED, Daemon
from tests.integration.test_migration import (
    ENGINE,
    PROMPTS,
    idle_and_leak_free,
    kill_decode_during_migrations,
    migrations_counted,
    outputs,
)

pytestmark = pytest.mark.skipif(
    not nixl.available(), reason="NIXL is not installed (pip install lmd[cluster])"
)
NIXL = ("--migration-transport", "nixl")


@pytest.mark.timeout(600)
def test_nixl_disaggregated_equals_hybrid_token_for_token() -> None:
    results = {}
    for mode, extra in (("hybrid", ()), ("disaggregated", NIXL)):
        daemon = Daemon("--mode", mode, *ENGINE, *extra)
        try:
            daemon.start()
            results[mode] = outputs(daemon)
            if mode == "disaggregated":
                idle_and_leak_free(daemon, ["prefill-0", "decode-0"])
                total = 2 * len(PROMPTS)
                prefill, decode = migrations_counted(daemon, total)
                assert prefill["transport"] == decode["transport"] == "nixl"
                migrated = (prefill["migration"]["count"], decode["migration"]["received"])
                assert migrated == (total, total)
                assert prefill["migration"]["bytes"] > 0
                assert prefill["migration"]["failures"] == 0
        finally:
            daemon.close()
    assert results["disaggregated"] == results["hybrid"]


def test_kill_decode_during_nixl_migrations() -> None:
    daemon = Daemon(*DISAGGREGATED, *NIXL, "--block-size", "16", "--heartbeat-timeout", "5")
    try:
        daemon.start()
        kill_decode_during_migrations(daemon)
    finally:
        daemon.close()
