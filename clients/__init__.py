"""lmd_client: Python clients for lmd.

`ControlClient` speaks the control API over the daemon's Unix socket; the OpenAI-API
`AsyncClient` arrives with the service issue.
"""

from __future__ import annotations

from lmd_client.control import ControlClient, ControlRequestError, DaemonNotRunning

__all__ = ["ControlClient", "ControlRequestError", "DaemonNotRunning"]
