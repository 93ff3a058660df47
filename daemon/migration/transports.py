"""Which transport moves an engine's KV: the one module that knows them all.

base.py is their interface; a transport's module is imported only once chosen (nixl is
an optional install, native loads lmd._native).
"""

from __future__ import annotations

from lmd.migration.base import PoolMemory


def transport_kind(device: str) -> str:
    """The memory between pools on `device`: host for cpu, cuda_ipc for cuda[:N]."""
    return "host" if device == "cpu" else "cuda_ipc"


def pool_memory(device: str, transport: str = "native") -> PoolMemory:
    """The pool memory of an engine on `device`, moved by `transport`: native (lmd._native's
    host or cuda_ipc) or nixl (lmd.migration.nixl, either memory)."""
    kind = transport_kind(device)
    if device == "cuda":  # torch's current device; the transport names it
        import torch

        device = f"cuda:{torch.cuda.current_device()}"
    if transport == "nixl":
        from lmd.migration.nixl import NixlTransport

        return PoolMemory(NixlTransport(), kind, device)
    if transport != "native":
        raise ValueError(f"unknown migration transport {transport!r}; use native or nixl")
    from lmd.migration.native import make_transport

    if kind == "host":
        return PoolMemory(make_transport("host"), kind, device)
    return PoolMemory(make_transport("cuda_ipc", device=device), kind, device)
