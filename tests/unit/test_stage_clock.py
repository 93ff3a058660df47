from __future__ import annotations

from lmd.engine import stage_clock
from lmd.engine.stage_clock import StageClock


def test_laps_average_per_stage() -> None:
    clock = StageClock()
    clock.start("a", now=0.0)
    clock.start("b", now=1.0)
    clock.lap("a", "reserve", now=0.002)
    clock.stop("a", "compute", now=0.052)
    clock.lap("b", "reserve", now=1.004)
    clock.stop("b", "compute", now=1.064)
    assert clock.to_dict() == {
        "reserve": {"count": 2, "mean_ms": 3.0},
        "compute": {"count": 2, "mean_ms": 55.0},
    }
    assert clock.num_tracked == 0


def test_unknown_and_forgotten_requests_count_nothing() -> None:
    clock = StageClock()
    clock.lap("ghost", "reserve", now=1.0)
    clock.start("a", now=0.0)
    clock.forget("a")
    clock.stop("a", "compute", now=1.0)
    assert clock.to_dict() == {} and clock.num_tracked == 0


def test_requests_that_never_finish_are_bounded(monkeypatch: object) -> None:
    clock = StageClock()
    for i in range(stage_clock.MAX_TRACKED + 10):
        clock.start(str(i), now=0.0)
    assert clock.num_tracked == stage_clock.MAX_TRACKED
