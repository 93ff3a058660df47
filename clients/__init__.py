"""lmd_client: Python clients for lmd.

- `AsyncClient` / `Client`: the OpenAI-compatible HTTP API (chat, completions, streams,
  retries on connection refused and 503); `AsyncClient.session()` for conversations the
  server remembers (`Session`, LMDeploy's /v1/chat/interactive).
- `ControlClient` / `SyncControlClient`: the control API over the daemon's Unix socket
  (what lmdctl uses), async and without await.
"""

from __future__ import annotations

from lmd_client.control import ControlClient, ControlRequestError, DaemonNotRunning
from lmd_client.errors import LmdError
from lmd_client.openai_client import AsyncClient, Completion, Delta, Usage
from lmd_client.session import Session, Turn
from lmd_client.sync_client import Client
from lmd_client.sync_control import SyncControlClient

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "ControlClient",
    "ControlRequestError",
    "DaemonNotRunning",
    "Delta",
    "LmdError",
    "Session",
    "SyncControlClient",
    "Turn",
    "Usage",
]
