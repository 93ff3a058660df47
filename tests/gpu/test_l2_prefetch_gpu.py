"""kernels/l2_prefetch.py on a GPU: the requests of every lane (whole chunks, a short
last one, lanes past the end) are issued without a fault and change no byte, eagerly
and inside a CUDA graph. Skipped without CUDA; on a GPU before sm_90 the launcher does
nothing, which is checked too.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from lmd.engine.turbo.kernels.l2_prefetch import prefetch_l2, supported

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize("nbytes", [16, 16384, 16384 + 16, 3 * 16384 - 48, 33 << 20])
@pytest.mark.parametrize("chunk", [16, 4096, 16384])
def test_prefetch_issues_every_lane_and_changes_nothing(nbytes: int, chunk: int) -> None:
    if nbytes // chunk > 1 << 16:
        pytest.skip("more lanes than a test needs")
    t = torch.randint(-(2**15), 2**15, (nbytes // 2,), device="cuda", dtype=torch.int16)
    before = t.clone()
    assert supported(t) == HOPPER
    prefetch_l2(t.view(torch.bfloat16), chunk=chunk)
    torch.cuda.synchronize()
    assert torch.equal(t, before)


def test_prefetch_in_a_graph_replays() -> None:
    weights = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(2, 4096, device="cuda", dtype=torch.bfloat16)
    prefetch_l2(*weights)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i, w in enumerate(weights):
            prefetch_l2(w)
            torch.mv(w, x, out=out[i])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    want = torch.stack([torch.mv(w, x) for w in weights])
    assert torch.equal(out, want)


def test_what_it_skips() -> None:
    t = torch.zeros(64, device="cuda", dtype=torch.bfloat16)
    assert not supported(t[1:])  # not 16-byte aligned
    assert not supported(t[:7])  # 14 bytes
    assert not supported(t.view(8, 8).t())  # not contiguous
    prefetch_l2(t[1:], t[:7], t.view(8, 8).t())  # skipped, no error
    torch.cuda.synchronize()
