"""Decode role: `scheduler` (pure, no I/O) keeps the persistent running batch."""

from __future__ import annotations
