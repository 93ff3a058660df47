"""The CPU KV pools of one daemon in its runtime dir (hybrid/pool_ledger.py): what an
engine added by lmdctl scale sees of the others' pools."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from lmd.engine.kv_pool import cpu_kv_free
from lmd.hybrid.pool_ledger import LEDGER_DIR, PoolLedger

GIB = 1 << 30


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_an_added_engine_sees_the_pools_of_the_live_others(tmp_path: Path) -> None:
    ledger = PoolLedger(tmp_path)
    entries = tmp_path / LEDGER_DIR
    # prefill-0 and decode-0 hold their pools (another live process: our parent).
    (entries / "prefill-0").write_text(f"{os.getppid()} {int(1.6 * GIB)}\n")
    (entries / "decode-0").write_text(f"{os.getppid()} {int(1.6 * GIB)}\n")
    # A worker killed with -9 left its entry behind; a stray file is no pool.
    (entries / "decode-7").write_text(f"{dead_pid()} {GIB}\n")
    (entries / "junk").write_text("not a pool\n")
    assert ledger.taken("decode-1") == {"prefill-0": int(1.6 * GIB), "decode-0": int(1.6 * GIB)}

    free = ledger.claim("decode-1", lambda taken: cpu_kv_free(24 * GIB, 2, taken), 0.8)
    assert free == 4 * GIB - int(3.2 * GIB)  # what the cap leaves, not a 2 GiB share
    # Until its pool exists, decode-1 holds the most it can take: a second engine
    # starting meanwhile does not count the same room.
    assert ledger.taken("decode-2")["decode-1"] == int(free * 0.8)
    ledger.record("decode-1", 233 * 2_949_120)
    assert ledger.taken("decode-2")["decode-1"] == 233 * 2_949_120
    assert "decode-1" not in ledger.taken("decode-1")  # its own pool is not another's
    ledger.remove("decode-1")
    ledger.remove("decode-1")  # twice is harmless
    assert "decode-1" not in ledger.taken("decode-2")


def test_a_block_count_claims_its_whole_share(tmp_path: Path) -> None:
    ledger = PoolLedger(tmp_path)
    assert ledger.claim("decode-0", lambda taken: 2 * GIB - taken, None) == 2 * GIB
    assert ledger.taken("prefill-0") == {"decode-0": 2 * GIB}
