from __future__ import annotations

import time

from lmd import stage_times
from lmd.stage_times import BUCKETS, StageClock, StageTimes


def test_observations_add_up_per_stage_with_a_histogram() -> None:
    times = StageTimes()
    times.observe("api", 0.0002)
    times.observe("api", 0.003)
    times.observe("step", 100.0)  # past the last bound: the +Inf bucket
    out = times.to_dict()
    assert out["api"]["count"] == 2 and abs(out["api"]["sum_s"] - 0.0032) < 1e-9
    assert len(out["api"]["buckets"]) == len(BUCKETS) + 1
    assert out["api"]["buckets"][BUCKETS.index(0.00025)] == 1  # 0.2 ms <= 0.25 ms
    assert out["api"]["buckets"][BUCKETS.index(0.005)] == 1
    assert out["step"]["buckets"][-1] == 1


def test_spans_from_other_processes_use_their_stamp_and_skip_bad_ones() -> None:
    times = StageTimes()
    times.since("to_api", time.time() - 0.01)
    times.since("to_api", 0.0)  # not stamped (a message built by a test or an old peer)
    times.since("to_api", time.time() + 5)  # a skewed clock: negative
    times.since("to_api", time.time() - 2 * stage_times.MAX_SPAN_S)
    out = times.to_dict()["to_api"]
    assert out["count"] == 1 and 0.01 <= out["sum_s"] < 1.0


def test_a_clock_laps_each_request_through_its_stages() -> None:
    times = StageTimes()
    clock = StageClock(times)
    clock.start("a", 100.0)
    clock.start("b", 101.0)
    clock.lap("a", "queue", 100.002)
    clock.stop("a", "prefill", 100.052)
    clock.lap("b", "queue", 101.004)
    clock.stop("b", "prefill", 101.064)
    out = times.to_dict()
    assert out["queue"]["count"] == 2 and abs(out["queue"]["sum_s"] - 0.006) < 1e-9
    assert out["prefill"]["count"] == 2 and abs(out["prefill"]["sum_s"] - 0.11) < 1e-9
    assert clock.num_tracked == 0


def test_unknown_unstamped_and_forgotten_requests_count_nothing() -> None:
    times = StageTimes()
    clock = StageClock(times)
    clock.lap("ghost", "queue", 1.0)
    clock.start("unstamped", 0.0)
    clock.stop("unstamped", "prefill", 1.0)
    clock.start("a", 10.0)
    clock.forget("a")
    clock.stop("a", "prefill", 11.0)
    assert times.to_dict() == {} and clock.num_tracked == 0


def test_requests_that_never_finish_are_bounded() -> None:
    clock = StageClock(StageTimes())
    for i in range(stage_times.MAX_TRACKED + 10):
        clock.start(str(i), 1.0)
    assert clock.num_tracked == stage_times.MAX_TRACKED
