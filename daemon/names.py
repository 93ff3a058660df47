"""Worker names, and what they tell: role, index, node. Pure.

A single-host daemon names its workers `<role>-<index>` (`decode-0`). In a cluster
(`lmdd serve --cluster ...`), every node suffixes its own with `@<node>` (`decode-0@b`),
so that names stay unique across hosts; the name is also the worker's ZeroMQ identity
and its inbox file name in the runtime directory.
"""

from __future__ import annotations

import re

NODE_NAME = re.compile(r"[A-Za-z0-9_]{1,32}")
# A worker name becomes a socket file name in the runtime directory: no paths.
WORKER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}(@[A-Za-z0-9_]{1,32})?")


def worker_name(role: str, index: int, node: str = "") -> str:
    return f"{role}-{index}@{node}" if node else f"{role}-{index}"


def role_of(name: str) -> str:
    return name.partition("@")[0].rsplit("-", 1)[0]


def index_of(name: str) -> int:
    """The worker's index within its role on its node (-1 if the name has none)."""
    tail = name.partition("@")[0].rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def node_of(name: str) -> str:
    """The node a worker runs on; "" for a single-host daemon's workers."""
    return name.partition("@")[2]
