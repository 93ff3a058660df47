"""`lmd-bench plan`: how many prefill and decode GPUs a workload needs to meet its SLOs.

    lmd-bench plan [--profile llama3-8b-h100 | profile.json] [--offline run.json ...]
        (--rate REQ_PER_S | --goodput REQ_PER_S) [--input-len 2048] [--output-len 256]
        [--dataset sharegpt.json [--tokenizer DIR]] [--num-requests 2000] [--seed 0]
        --ttft-ms MS --tpot-ms MS [--attainment 0.99] [--max-gpus 64]
        [--migration-gbps G] [--max-batch N] [--kv-capacity-tokens N]
        [--max-prefill-token-num N]

Simulates the cluster (plan_sim.py) on one seeded workload for every configuration the
search (plan_search.py) tries, and prints each with its goodput, SLO attainment, TTFT and
TPOT percentiles and utilisation; then the cheapest disaggregated configuration and the
cheapest hybrid one. `--goodput G` asks for G requests/s within the SLOs: the offered load
is then G / attainment. docs/scale-out.md explains the model and its limits.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from lmd.bench import plan_workload
from lmd.bench.plan_presets import PRESETS, load_profile, with_offline_runs
from lmd.bench.plan_profile import profile_from_json
from lmd.bench.plan_search import Candidate, Planner, Target
from lmd.bench.plan_workload import LengthDist, SimRequest

OVERRIDES = ("migration_gbps", "max_batch", "kv_capacity_tokens")  # flags = profile keys


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="prefill:decode GPUs for a workload and its SLOs (simulated)")
    p.add_argument("--profile", default="llama3-8b-h100",
                   help=f"a preset ({', '.join(PRESETS)}) or a profile JSON file")  # fmt: skip
    p.add_argument("--offline", nargs="+", type=Path, default=[], metavar="RUN.json",
                   help="lmd-bench offline --out files: they replace the step tables")  # fmt: skip
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="offered load, Poisson requests per second")
    load.add_argument("--goodput", type=float,
                      help="req/s within the SLOs (offered: this / --attainment)")  # fmt: skip
    p.add_argument("--input-len", default="2048", help="N, uniform:LO:HI, (log)normal:MEAN:SD")
    p.add_argument("--output-len", default="256", help="as --input-len (first token included)")
    p.add_argument("--dataset", type=Path, help="ShareGPT JSON: lengths from it instead")
    p.add_argument("--tokenizer", help="tokenizer.json or model dir, to count ShareGPT tokens")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0, help="lengths and arrival times")
    p.add_argument("--ttft-ms", type=float, help="SLO: time to first token")
    p.add_argument("--tpot-ms", type=float, help="SLO: time per output token after the first")
    p.add_argument("--attainment", type=float, default=0.99,
                   help="fraction of requests that must meet every SLO")  # fmt: skip
    p.add_argument("--max-gpus", type=int, default=64, help="search bound, GPUs in all")
    p.add_argument("--migration-gbps", type=float, help="override: prefill->decode link, Gb/s")
    p.add_argument("--max-batch", type=int, help="override: decode batch cap")
    p.add_argument("--kv-capacity-tokens", type=int, help="override: KV pool per worker, tokens")
    p.add_argument("--max-prefill-token-num", type=int, help="override: tokens per prefill step")
    p.set_defaults(run=run)


def _check(args: argparse.Namespace) -> None:
    slos = (args.ttft_ms, args.tpot_ms)
    if all(v is None for v in slos):
        raise ValueError("give an SLO: --ttft-ms and/or --tpot-ms")
    if any(v is not None and not 0 < v < math.inf for v in slos):
        raise ValueError("--ttft-ms and --tpot-ms must be > 0")
    if not 0 < args.attainment <= 1:
        raise ValueError("--attainment must be in (0, 1], e.g. 0.99")
    if not 0 < _load(args) < 1e9:
        raise ValueError("--rate / --goodput must be > 0")
    if args.num_requests < 1 or args.max_gpus < 2:
        raise ValueError("--num-requests must be >= 1 and --max-gpus >= 2")


def _load(args: argparse.Namespace) -> float:
    """The offered load in requests per second: --goodput G needs G / attainment."""
    return float(args.rate if args.rate is not None else args.goodput / args.attainment)


def _profile(args: argparse.Namespace) -> dict[str, Any]:
    data = load_profile(args.profile)
    if args.offline:
        data = with_offline_runs(data, args.offline)
    for key in OVERRIDES:
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    if args.max_prefill_token_num is not None:
        data["prefill"] = {**data["prefill"], "max_tokens": args.max_prefill_token_num}
    return data


def _requests(args: argparse.Namespace, rate: float) -> tuple[list[SimRequest], dict[str, Any]]:
    n = args.num_requests
    about: dict[str, Any] = {"num_requests": n, "rate": rate, "seed": args.seed}
    if args.dataset is not None:
        made = plan_workload.sharegpt(args.dataset, n, rate, tokenizer=args.tokenizer,
                                      seed=args.seed)  # fmt: skip
        return made, about | {"dataset": str(args.dataset)}
    inputs = LengthDist.parse(args.input_len, "--input-len")
    outputs = LengthDist.parse(args.output_len, "--output-len")
    made = plan_workload.synthetic(n, rate, inputs, outputs, args.seed)
    return made, about | {"input_len": inputs.describe(), "output_len": outputs.describe()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    _check(args)
    profile = profile_from_json(_profile(args), args.profile)
    rate = _load(args)
    requests, workload = _requests(args, rate)
    slos = {k: v for k, v in (("ttft", args.ttft_ms), ("tpot", args.tpot_ms)) if v is not None}
    planner = Planner(profile, requests, args.num_requests / rate,
                      Target(slos, args.attainment, args.max_gpus))  # fmt: skip
    chosen, hybrid = planner.best_disaggregated(), planner.best_hybrid()
    return {
        "benchmark": "plan",
        "profile": profile.to_json(),
        "workload": workload | {
            "mean_input_len": round(sum(r.input_len for r in requests) / len(requests), 1),
            "mean_output_len": round(sum(r.output_len for r in requests) / len(requests), 1)},
        "target": {"slo_ms": slos, "attainment": args.attainment, "goodput": args.goodput,
                   "max_gpus": args.max_gpus},
        "lower_bounds": planner.lower_bounds(),
        "candidates": [c.to_json() for c in planner.candidates()],
        "chosen": None if chosen is None else chosen.to_json(),
        "hybrid": None if hybrid is None else hybrid.to_json(),
        "verdict": verdict(chosen, hybrid, args.max_gpus),
    }  # fmt: skip


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def verdict(chosen: Candidate | None, hybrid: Candidate | None, max_gpus: int) -> str:
    if chosen is None and hybrid is None:
        return f"no configuration of at most {max_gpus} GPUs meets the target"
    if chosen is None or hybrid is None:
        best, mode = (chosen, "disaggregated") if chosen else (hybrid, "hybrid")
        assert best is not None
        return f"only {mode} meets it within {max_gpus} GPUs: {best.label}, {_gpus(best.gpus)}"
    if hybrid.gpus < chosen.gpus:
        return f"hybrid is cheaper: {_gpus(hybrid.gpus)} against {chosen.gpus}"
    if hybrid.gpus > chosen.gpus:
        return f"disaggregated is cheaper: {_gpus(chosen.gpus)} against {hybrid.gpus}"
    return f"both need {chosen.gpus} GPUs"


def _ms(stats: dict[str, float | None], q: str) -> str:
    value = stats[q]
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _row(c: dict[str, Any], mark: str) -> list[str]:
    u = c["utilisation"]
    return [
        mark + c["config"], str(c["gpus"]), "yes" if c["meets_target"] else "no",
        f"{c['goodput']:.2f}", f"{c['slo_attainment']:.1%}",
        _ms(c["ttft_ms"], "p50"), _ms(c["ttft_ms"], "p99"),
        _ms(c["tpot_ms"], "p50"), _ms(c["tpot_ms"], "p99"),
        f"{u['prefill_busy']:.0%}/{u['decode_busy']:.0%}",
        f"{u['link_busy']:.0%}" if c["mode"] == "disaggregated" else "-",
        f"{u['decode_batch_mean']:.1f}",
    ]  # fmt: skip


HEADER = ["config", "GPUs", "meets", "goodput/s", "in SLO", "TTFT p50", "TTFT p99",
          "TPOT p50", "TPOT p99", "busy P/D", "link", "batch"]  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    w, t, p = result["workload"], result["target"], result["profile"]
    if "dataset" in w:
        lengths = f"lengths from {w['dataset']}"
    else:
        lengths = f"input {w['input_len']}, output {w['output_len']}"
    slos = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in t["slo_ms"].items())
    bounds = result["lower_bounds"]
    lines = [
        f"profile {p['name']}; link {p['migration_gbps']:g} Gb/s, "
        f"{p['kv_bytes_per_token'] / 1024:g} KiB of KV per token",
        f"workload: {w['num_requests']} requests, Poisson {w['rate']:.3g} req/s, {lengths} "
        f"(means {w['mean_input_len']:g} / {w['mean_output_len']:g}), seed {w['seed']}",
        f"target: {slos} for {t['attainment']:.1%} of requests"
        + (f" (goodput {t['goodput']:g} req/s)" if t["goodput"] else ""),
        f"throughput lower bounds: prefill {bounds['prefill']}, decode {bounds['decode']}, "
        f"hybrid {bounds['hybrid']} workers",
        "",
    ]
    picked = {(c or {}).get("config") for c in (result["chosen"], result["hybrid"])}
    rows = [HEADER] + [_row(c, "*" if c["config"] in picked else " ")
                       for c in result["candidates"]]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for r in rows:
        lines.append("  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                               for i, cell in enumerate(r)).rstrip())  # fmt: skip
    lines.append("")
    for name, key in (("disaggregated", "chosen"), ("hybrid", "hybrid")):
        c = result[key]
        if c is None:
            lines.append(f"{name}: nothing of at most {t['max_gpus']} GPUs meets the target")
            continue
        ratio = f", P:D = {c['prefill_workers']}:{c['decode_workers']}" if key == "chosen" else ""
        lines.append(
            f"{name}: {c['config']} = {_gpus(c['gpus'])}{ratio}, goodput "
            f"{c['goodput']:.2f} req/s, {c['slo_attainment']:.1%} within the SLOs"
        )
    lines.append(f"verdict: {result['verdict']}")
    lines.append("busy P/D: prefill / decode busy time (hybrid: shares of the same GPU); "
                 "link: KV transfer busy time; batch: mean decode batch; * = chosen")  # fmt: skip
    return "\n".join(lines)
