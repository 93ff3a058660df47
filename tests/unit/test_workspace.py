"""Workspace: reused CPU buffers, grown when a step needs more rows."""

from __future__ import annotations

import torch

from lmd.engine.workspace import Workspace

CPU = torch.device("cpu")


def test_a_name_reuses_its_buffer_and_grows_when_needed() -> None:
    ws = Workspace()
    a = ws.get("probs", 4, 10, CPU)
    assert a.shape == (4, 10) and a.is_contiguous()
    b = ws.get("probs", 3, 10, CPU)
    assert b.data_ptr() == a.data_ptr()  # the same memory: no fresh pages
    c = ws.get("probs", 9, 10, CPU)  # more rows than held: a larger buffer
    assert c.shape == (9, 10) and ws.get("probs", 9, 10, CPU).data_ptr() == c.data_ptr()
    other = ws.get("mask", 9, 10, CPU, torch.bool)
    assert other.dtype == torch.bool and other.data_ptr() != c.data_ptr()
    assert ws.nbytes == 9 * 10 * 4 + 9 * 10
