"""KV migration between prefill and decode processes (ARCHITECTURE §4).

`native` is the typed facade over the C++ transfer engine (lmd._native);
`bench_native` measures it.
"""

from __future__ import annotations
