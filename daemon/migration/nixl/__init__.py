"""The `nixl` migration transport: KV copies through NVIDIA's NIXL library (UCX backend).

An optional install (`pip install lmd[cluster]`); without it this package imports, and
`NixlTransport()` raises a one-line RuntimeError saying what to install. One code path
moves host memory (CPU pools: UCX takes shared memory or TCP) and GPU memory (CUDA
pools: cuda_ipc on one host, GPUDirect RDMA across hosts).

Life cycle of one migration link (the verbs of base.MigrationTransport, as native.py):
  1. each process makes one `NixlTransport()` (transport.py), whose agent (agent.py) is
     named lmd-<pid>-<random> and runs the UCX backend with its progress thread;
  2. decode registers its whole KV pool once: `create_region(nbytes)` (host memory this
     package allocates; the pool views `memoryview(region)`) or `register(ptr, nbytes,
     "cuda:N")`. `region.descriptor()` (descriptor.py: the agent's name and metadata,
     the pool's address, length and device) travels in every Reserved message;
  3. prefill: `peer = open(descriptor)` loads decode's metadata, once per agent; that
     is all the two agents need to connect;
  4. prefill, per request: `submit(src, peer, copies)` posts one batched WRITE of the
     contiguous ranges and returns at once; `ticket.poll()` asks NIXL without blocking,
     `ticket.wait(timeout_s)` polls with short sleeps. A write to a peer that died ends
     in RuntimeError (UCX reports the disconnect) or, at worst, at the caller's
     timeout: never a hang, never a crash. `submit(..., notify=b"...")` also hands the
     receiver a notification (`notifications()`) once the data is there; the daemon
     does not ask for one: its Migrated message, sent once the ticket is done, is that
     notification (NIXL's UCX backend flushes the endpoint before it reports a write
     done: the bytes are in the peer's memory by then);
  5. `close()` regions (deregistered), peers (an agent is forgotten, and disconnected,
     with its last open peer) and the transport (writes in flight fail, UCX stops).
"""

from __future__ import annotations

import importlib.util

from lmd.migration.nixl.agent import INSTALL_HINT, bindings
from lmd.migration.nixl.transport import (
    NAME,
    NixlHostRegion,
    NixlPeer,
    NixlRegion,
    NixlTicket,
    NixlTransport,
)

__all__ = [
    "INSTALL_HINT",
    "NAME",
    "NixlHostRegion",
    "NixlPeer",
    "NixlRegion",
    "NixlTicket",
    "NixlTransport",
    "available",
    "installed",
]


def installed() -> bool:
    """Whether the nixl package is there (found, not imported: importing it imports torch)."""
    return importlib.util.find_spec("nixl") is not None


def available() -> bool:
    """Whether NIXL imports here (tests skip without it)."""
    try:
        bindings()
    except RuntimeError:
        return False
    return True
