"""KV migration between prefill and decode processes (docs/architecture.md §1, steps 3-4).

`native` is the typed facade over the C++ transfer engine (lmd._native); `nixl` the
optional transport over NVIDIA NIXL (`pip install lmd[cluster]`); `bench_native`
measures them.
"""

from __future__ import annotations
