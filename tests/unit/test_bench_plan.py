"""`lmd-bench plan`: the simulation against known answers, the search, the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from lmd.bench import main
from lmd.bench.plan_presets import PRESETS, with_offline_runs
from lmd.bench.plan_profile import WorkerProfile, kv_bytes_per_token, profile_from_json
from lmd.bench.plan_search import HYBRID, Planner, Target
from lmd.bench.plan_sim import SimResult, simulate_disaggregated, simulate_hybrid
from lmd.bench.plan_workload import LengthDist, SimRequest, synthetic


def make_profile(**changes: Any) -> WorkerProfile:
    data: dict[str, Any] = {
        "prefill": {"tokens": [1, 1000], "step_ms": [10.0, 100.0], "max_tokens": 4096},
        "decode": {"batch_sizes": [1, 64], "step_ms": [10.0, 20.0]},
        "max_batch": 64,
        "kv_bytes_per_token": 100_000,
        "migration_gbps": 100,
        "migration_latency_ms": 1.0,
    }
    data |= changes
    return profile_from_json(data, "test")


def ttfts(requests: list[SimRequest], result: SimResult) -> list[float]:
    return [f - r.arrival for r, f in zip(requests, result.first_token, strict=True)]


def workload(num: int, rate: float, input_len: str, output_len: str) -> list[SimRequest]:
    dist_in, dist_out = LengthDist.parse(input_len, "in"), LengthDist.parse(output_len, "out")
    return synthetic(num, rate, dist_in, dist_out, seed=1)


# The simulation against answers worked out by hand.


def test_one_request_ttft_is_prefill_plus_migration_and_tpot_one_step() -> None:
    profile = make_profile()
    request = SimRequest(arrival=0.5, input_len=500, output_len=11)
    result = simulate_disaggregated(profile, [request], 1, 1)
    prefill = 10.0 + 90.0 * 499 / 999  # ms, interpolated between (1, 10) and (1000, 100)
    migration = 500 * 100_000 * 8 / 100e9 * 1e3 + 1.0  # bytes over 100 Gb/s, + latency
    assert result.first_token[0] - 0.5 == pytest.approx((prefill + migration) / 1e3)
    tpot = (result.end[0] - result.first_token[0]) / 10
    assert tpot == pytest.approx(0.010)  # batch 1: 10 ms a step


def test_hybrid_one_request_has_no_migration() -> None:
    result = simulate_hybrid(make_profile(), [SimRequest(0.0, 1000, 3)], 1)
    assert result.first_token[0] == pytest.approx(0.100)
    assert result.end[0] == pytest.approx(0.120)


def test_a_sequence_joining_mid_stretch_waits_for_the_step_boundary() -> None:
    # Prefill 5 ms whatever the size, migration ~0; decode 10 ms at batch 1, 20 at 2.
    profile = make_profile(
        prefill={"tokens": [1, 1000], "step_ms": [5.0, 5.0]},
        decode={"batch_sizes": [1, 2], "step_ms": [10.0, 20.0]},
        migration_gbps=1e9, migration_latency_ms=0.0, kv_bytes_per_token=1,
    )  # fmt: skip
    a, b = SimRequest(0.0, 10, 11), SimRequest(0.0301, 10, 3)
    result = simulate_disaggregated(profile, [a, b], 1, 1)
    # A decodes alone from 5 ms (steps end 15, 25, 35, 45); B's first token at 35.1 ms,
    # it joins at 45; two steps of 20 ms end B at 85; A's last 4 steps alone end at 125.
    assert result.first_token[1] == pytest.approx(0.0351)
    assert result.end[1] == pytest.approx(0.085)
    assert result.end[0] == pytest.approx(0.125)


def test_queueing_matches_pollaczek_khinchine_for_md1() -> None:
    # One prompt per step (max_tokens = the prompt), a fixed 100 ms step, Poisson arrivals
    # at load 0.7: the mean wait of M/D/1 is rho * S / (2 * (1 - rho)).
    profile = make_profile(
        prefill={"tokens": [1, 1000], "step_ms": [100.0, 100.0], "max_tokens": 1000},
        max_batch=1_000_000,
    )
    requests = workload(20_000, 7.0, "1000", "1")
    result = simulate_disaggregated(profile, requests, 1, 1)
    mean_wait = sum(t - 0.1 for t in ttfts(requests, result)) / len(requests)
    assert mean_wait == pytest.approx(0.7 * 0.1 / (2 * 0.3), rel=0.1)


def test_decode_kv_capacity_holds_requests_back() -> None:
    profile = make_profile(kv_capacity_tokens=1500)
    requests = [SimRequest(0.0, 1000, 100), SimRequest(0.0, 1000, 100)]
    result = simulate_disaggregated(profile, requests, 2, 1)
    assert result.num_waited == 1
    assert result.first_token[1] > result.end[0]  # prefilled only once the first ended
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        simulate_disaggregated(profile, [SimRequest(0.0, 1500, 1)], 1, 1)


def test_prefill_reserves_two_steps_ahead_as_the_prefill_worker_does() -> None:
    from lmd.bench import plan_sim
    from lmd.prefill.worker import RESERVE_AHEAD_STEPS

    assert plan_sim.RESERVE_AHEAD_STEPS == RESERVE_AHEAD_STEPS
    # Ten 1,000-token prompts at once, 1,000 tokens a step, room for three sequences in
    # decode: it is asked for two, the rest only as prompts complete (each decodes for one
    # 10 ms step), so no reservation ever waits; asking for all ten at once would.
    profile = make_profile(prefill={"tokens": [1, 1000], "step_ms": [10.0, 100.0],
                                    "max_tokens": 1000}, kv_capacity_tokens=3 * 1002)  # fmt: skip
    requests = [SimRequest(0.0, 1000, 2)] * 10
    result = simulate_disaggregated(profile, requests, 1, 1)
    assert result.num_waited == 0
    assert result.first_token[-1] > 10 * 0.1


# Properties of the model.


def planner(
    requests: list[SimRequest], rate: float, profile: WorkerProfile, **slos: float
) -> Planner:
    window = len(requests) / rate  # workload() spreads them over it
    return Planner(profile, requests, window, Target(slos, attainment=0.95, max_gpus=8))


def test_more_workers_never_lower_goodput() -> None:
    requests = workload(600, 12.0, "uniform:500:1500", "uniform:100:300")
    plan = planner(requests, 12.0, make_profile(), ttft=400.0, tpot=14.0)
    goodput = {
        (p, d): plan.evaluate("disaggregated", p, d).metrics["goodput"]
        for p in (1, 2, 3) for d in (1, 2, 3)
    }  # fmt: skip
    for (p, d), value in goodput.items():
        for more in ((p + 1, d), (p, d + 1)):
            assert goodput.get(more, value) >= value
    # Both kinds matter here: one decode worker is too few, and so is one prefill worker.
    assert goodput[(1, 1)] < goodput[(1, 2)] < goodput[(2, 2)]


def test_overload_makes_slo_attainment_fall() -> None:
    profile = make_profile()
    attained = []
    for rate in (2.0, 8.0, 16.0, 32.0):
        requests = workload(400, rate, "800", "40")
        plan = planner(requests, rate, profile, ttft=500.0, tpot=25.0)
        attained.append(plan.evaluate("disaggregated", 1, 1).metrics["slo_attainment"])
    assert attained == sorted(attained, reverse=True)
    assert attained[0] == 1.0 and attained[-1] < 0.2


def test_prefill_interrupts_hybrid_decoding() -> None:
    # Long prompts: in hybrid, every prefill step stalls the running batch's next token.
    requests = workload(300, 4.0, "3000", "100")
    profile = make_profile()
    hybrid = simulate_hybrid(profile, requests, 2)
    split = simulate_disaggregated(profile, requests, 1, 1)

    def tpot_p99(result: SimResult) -> float:
        tpots = sorted((e - f) / 99 for f, e in zip(result.first_token, result.end, strict=True))
        return tpots[int(0.99 * len(tpots))]

    assert tpot_p99(hybrid) > 2 * tpot_p99(split)


def test_search_picks_the_fewest_gpus() -> None:
    requests = workload(300, 20.0, "uniform:800:1600", "uniform:30:90")
    plan = planner(requests, 20.0, make_profile(), ttft=300.0, tpot=15.0)
    chosen, hybrid = plan.best_disaggregated(), plan.best_hybrid()
    assert chosen is not None and chosen.feasible
    everything = Planner(plan.profile, requests, plan.window, plan.target)
    feasible = [
        c.gpus for p in range(1, 8) for d in range(1, 9 - p)
        if (c := everything.evaluate("disaggregated", p, d)).feasible
    ]  # fmt: skip
    assert chosen.gpus == min(feasible)
    # Every prefill step (100+ ms) stalls a hybrid batch: 15 ms a token cannot hold there.
    assert hybrid is None
    assert not any(everything.evaluate(HYBRID, h).feasible for h in range(1, 9))


def test_hybrid_search_picks_the_fewest_workers() -> None:
    requests = workload(300, 50.0, "uniform:100:300", "uniform:30:90")
    plan = planner(requests, 50.0, make_profile(), ttft=300.0, tpot=40.0)
    hybrid = plan.best_hybrid()
    feasible = [h for h in range(1, 9) if plan.evaluate(HYBRID, h).feasible]
    assert hybrid is not None and hybrid.gpus == min(feasible) > 1


# Profiles and workloads.


def test_profile_schema_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="migration_gbps is required"):
        profile_from_json({"prefill": {"tokens_per_s": 1000}, "decode": {"batch_sizes": [1],
                           "step_ms": [5]}, "kv_bytes_per_token": 2})  # fmt: skip
    with pytest.raises(ValueError, match="unknown key 'step'"):
        make_profile(decode={"batch_sizes": [1], "step": [5]})
    with pytest.raises(ValueError, match="batch_sizes must increase"):
        make_profile(decode={"batch_sizes": [8, 1], "step_ms": [5, 6]})


def test_prefill_as_a_rate_and_the_presets() -> None:
    profile = make_profile(prefill={"tokens_per_s": 10_000, "overhead_ms": 2})
    assert profile.prefill_step_ms(5000) == pytest.approx(502.0)
    assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024  # Llama-3-8B in bf16
    for name, data in PRESETS.items():
        assert profile_from_json(data, name).prefill_tokens_per_s > 0


def test_offline_runs_become_the_step_tables(tmp_path: Path) -> None:
    def run(name: str, batch: int, input_len: int, output_len: int, seconds: float) -> Path:
        path = tmp_path / f"{name}.json"
        record = {"benchmark": "offline", "batch": batch, "seconds": seconds,
                  "input_len": input_len, "output_len": output_len}  # fmt: skip
        path.write_bytes(orjson.dumps(record))
        return path

    paths = [run("p1", 1, 512, 1, 0.02), run("p8", 8, 512, 1, 0.1), run("d8", 8, 512, 11, 0.3)]
    data = with_offline_runs(dict(PRESETS["llama3-8b-h100"]), paths)
    profile = profile_from_json(data)
    assert profile.prefill_tokens == (512.0, 4096.0)
    # (0.3 s - the 100 ms prefill of 8 x 512 tokens) over 10 steps
    assert profile.decode_batch == (8.0,) and profile.decode_ms[0] == pytest.approx(20.0)
    serve = tmp_path / "serve.json"
    serve.write_bytes(orjson.dumps({"benchmark": "serve", "completed": 3}))
    with pytest.raises(ValueError, match="not the JSON of"):
        with_offline_runs({}, [serve])


def test_length_specs_and_seeded_workloads() -> None:
    a = workload(2000, 10.0, "lognormal:1000:500", "normal:100:10")
    assert a == workload(2000, 10.0, "lognormal:1000:500", "normal:100:10")
    assert sum(r.input_len for r in a) / len(a) == pytest.approx(1000, rel=0.05)
    assert all(r.arrival < 200.0 for r in a) and a[-1].arrival > 190.0
    for bad in ("zipf:3", "uniform:9:3", "0", "normal:x:1"):
        with pytest.raises(ValueError, match="--input-len"):
            LengthDist.parse(bad, "--input-len")


# The command line.

PLAN = ["plan", "--rate", "10", "--input-len", "1024", "--output-len", "64",
        "--num-requests", "300", "--ttft-ms", "500", "--tpot-ms", "30"]  # fmt: skip


def test_cli_prints_the_table_and_the_choice(capsys: Any) -> None:
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert "config" in out and "TTFT p99" in out and "busy P/D" in out
    assert "disaggregated: " in out and "hybrid: " in out and "verdict: " in out
    assert any(line.startswith("*") and "P+" in line for line in out.splitlines())


def test_cli_json_is_one_object(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "plan.json"
    assert main([*PLAN, "--json", "--out", str(out)]) == 0
    printed = orjson.loads(capsys.readouterr().out)
    assert printed == orjson.loads(out.read_bytes())
    assert printed["benchmark"] == "plan" and printed["chosen"]["meets_target"]
    rows = printed["candidates"]
    assert {"config", "gpus", "goodput", "slo_attainment", "ttft_ms", "utilisation"} <= set(rows[0])
    assert printed["chosen"]["config"] in {r["config"] for r in rows}


def test_cli_takes_lengths_from_a_sharegpt_file(tmp_path: Path, capsys: Any) -> None:
    turns = [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "x " * 100}]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_bytes(orjson.dumps([{"conversations": turns}] * 3))
    assert main([*PLAN, "--dataset", str(dataset)]) == 0
    out = capsys.readouterr().out
    assert f"lengths from {dataset}" in out and "(means 500 / 50)" in out  # ~4 chars a token


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--input-len", "zipf:2"], "--input-len 'zipf:2'"),
        (["--profile", "no-such-gpu"], "neither a preset"),
        (["--attainment", "1.5"], "--attainment"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(extra: list[str], message: str, capsys: Any) -> None:
    assert main([*PLAN, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_profile_file_and_overrides(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "gpu.json"
    data = {k: v for k, v in PRESETS["llama3-8b-h100"].items() if k != "migration_gbps"}
    path.write_bytes(orjson.dumps(data))
    assert main([*PLAN, "--profile", str(path)]) == 2
    assert "migration_gbps is required" in capsys.readouterr().err
    assert main([*PLAN, "--profile", str(path), "--migration-gbps", "25", "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out)["profile"]["migration_gbps"] == 25


def test_cli_needs_a_load(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--ttft-ms", "100"])
    assert exit_info.value.code == 2
