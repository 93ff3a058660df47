"""LmdError: what every lmd_client call raises when the server answers with an error.

Its own module so that the client and the session (which the client makes) both raise it
without importing each other.
"""

from __future__ import annotations


class LmdError(RuntimeError):
    """The server answered with an error body (or could not be reached after retries)."""

    def __init__(self, status: int, type: str, message: str) -> None:
        super().__init__(f"{status} {type}: {message}")
        self.status, self.type, self.message = status, type, message
