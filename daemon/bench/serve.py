"""`lmd-bench serve`: TTFT, TPOT, ITL, E2E, throughput and goodput of any OpenAI server.

    lmd-bench serve --url http://127.0.0.1:23333 [--endpoint /v1/chat/completions]
        [--num-prompts 200] [--concurrency N | --request-rate R] [--input-len 512]
        [--output-len 128] [--range-ratio 0] [--dataset sharegpt.json | --prefix-len N]
        [--ignore-eos] [--goodput ttft:500 tpot:50] [--out run.json] [--plot run.png]

One asyncio process streams every request (server-sent events, usage asked for through
stream_options) and times each text chunk; serve_metrics.py defines the figures. A warm-up
request (random words, not one of the measured prompts, so that it leaves nothing measured
in a prefix cache) goes first and is not counted; when it fails the run stops with its error.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from lmd.bench import serve_data, serve_stages
from lmd.bench.serve_client import Load, Run, Target, first_model, http_client, run_load, send
from lmd.bench.serve_data import Prompt
from lmd.bench.serve_metrics import RequestResult, parse_slos, summarize
from lmd.bench.serve_plot import plot_serve, require_matplotlib
from lmd.bench.serve_processes import run_processes

WARM_UP_TOKENS = 16  # enough to run every code path once
WARM_UP_SEED = 7_919_001  # far from the seeds people pick, so never a measured prompt
CLIENT_BUSY = 0.85  # a client process this busy may be what set the pace


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="latency and throughput of an OpenAI-compatible server")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:23333")
    p.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    p.add_argument("--model", help="default: the first one the server lists at /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a Bearer token (default: $OPENAI_API_KEY)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--concurrency", type=int, help="at most this many in flight (default: no cap)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    p.add_argument("--input-len", type=int, default=512, help="random/shared-prefix words")
    p.add_argument("--output-len", type=int,
                   help="max_tokens (default 128; ShareGPT: the recorded answer's)")  # fmt: skip
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random lengths in [len*(1-r), len*(1+r)]")  # fmt: skip
    p.add_argument("--dataset", type=Path, help="a ShareGPT JSON file instead of random words")
    p.add_argument("--tokenizer", help="tokenizer.json or model dir, to size ShareGPT answers")
    p.add_argument("--prefix-len", type=int, default=0, help="shared-prefix dataset: words")
    p.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix dataset: groups")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (not OpenAI's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2e:10000")  # fmt: skip
    p.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds")
    p.add_argument("--warmup", type=int, default=1, help="uncounted requests sent first")
    p.add_argument("--label", help="this run's name in `lmd-bench compare`")
    p.add_argument("--client-processes", type=int, default=1,
                   help="drive the load from this many processes (one parses ~30k SSE "
                        "tokens/s; see client_cpu_cores)")  # fmt: skip
    p.add_argument("--stages", action=argparse.BooleanOptionalAction, default=True,
                   help="an lmd server's per-stage times and CPU from its /metrics")  # fmt: skip
    p.add_argument("--plot", type=Path, help="PNG: latency CDFs, throughput over time")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   help="progress bar on stderr (default: when stderr is a terminal)")  # fmt: skip
    p.set_defaults(run=run)


def _check(args: argparse.Namespace) -> None:
    problems = [
        (args.num_prompts < 1, "--num-prompts must be >= 1"),
        (args.concurrency is not None and args.concurrency < 1, "--concurrency must be >= 1"),
        (not args.request_rate > 0, "--request-rate must be > 0"),
        (args.input_len < 1 or (args.output_len or 1) < 1, "--input-len, --output-len >= 1"),
        (not 0 <= args.range_ratio < 1, "--range-ratio must be in [0, 1)"),
        (args.prefix_len < 0 or args.num_prefixes < 1, "--prefix-len >= 0, --num-prefixes >= 1"),
        (args.dataset is not None and args.prefix_len > 0, "--dataset or --prefix-len, not both"),
        (args.timeout <= 0 or args.warmup < 0, "--timeout must be > 0, --warmup >= 0"),
        (
            not 1 <= args.client_processes <= (args.concurrency or math.inf),
            "--client-processes must be >= 1 and <= --concurrency",
        ),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(message)


def prompts(args: argparse.Namespace) -> tuple[list[Prompt], dict[str, Any]]:
    """The run's prompts and how they were made (recorded in the JSON)."""
    n, seed = args.num_prompts, args.seed
    if args.dataset is not None:
        count = serve_data.token_counter(args.tokenizer)
        made = serve_data.sharegpt_prompts(args.dataset, n, args.output_len, count, seed)
        return made, {"name": "sharegpt", "file": str(args.dataset), "output_len": args.output_len}
    output_len = args.output_len or 128
    if args.prefix_len > 0:
        made = serve_data.shared_prefix_prompts(
            n, args.num_prefixes, args.prefix_len, args.input_len, output_len, seed=seed
        )
        about = {"name": "shared-prefix", "prefix_len": args.prefix_len,
                 "num_prefixes": args.num_prefixes}  # fmt: skip
        return made, {**about, "input_len": args.input_len, "output_len": output_len}
    made = serve_data.random_prompts(n, args.input_len, output_len, args.range_ratio, seed)
    return made, {"name": "random", "input_len": args.input_len, "output_len": output_len,
                  "range_ratio": args.range_ratio}  # fmt: skip


class Progress:
    """`[#####.....] 45/200 failed 1 12.3 s` on stderr, redrawn at most 10 times a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.done = self.failed = 0
        self.began = self.drawn = time.monotonic()

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.ok
        now = time.monotonic()
        if self.enabled and (now - self.drawn >= 0.1 or self.done == self.total):
            self.drawn = now
            filled = 30 * self.done // self.total
            bar = "#" * filled + "." * (30 - filled)
            end = "\n" if self.done == self.total else ""
            print(f"\r[{bar}] {self.done}/{self.total} failed {self.failed} "
                  f"{now - self.began:.1f} s", end=end, file=sys.stderr, flush=True)  # fmt: skip


def _extra_body(text: str) -> tuple[tuple[str, Any], ...]:
    try:
        extra = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not JSON: {exc}") from exc
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    return tuple(extra.items())


def warm_up_prompts(args: argparse.Namespace, items: list[Prompt]) -> list[Prompt]:
    """Random words of the first prompt's length, never a measured prompt (nor a shared
    prefix): a warm-up must not fill the server's prefix cache with what is measured."""
    length, max_tokens = items[0].input_len, min(items[0].output_len, WARM_UP_TOKENS)
    seed = args.seed + WARM_UP_SEED
    return serve_data.random_prompts(args.warmup, length, max_tokens, 0.0, seed)


async def _bench(
    args: argparse.Namespace, items: list[Prompt]
) -> tuple[Target, Run, str, dict[str, Any]]:
    target = Target(
        url=args.url.rstrip("/"), model=args.model or "", endpoint=args.endpoint,
        api_key=args.api_key, ignore_eos=args.ignore_eos, temperature=args.temperature,
        timeout_s=args.timeout, extra_body=_extra_body(args.extra_body),
    )  # fmt: skip
    load = Load(request_rate=args.request_rate, concurrency=args.concurrency, seed=args.seed)
    async with http_client(target) as client:
        if not target.model:
            target = dataclasses.replace(target, model=await first_model(client, target))
        warm = [await send(client, target, p) for p in warm_up_prompts(args, items)]
        if warm and not any(r.ok for r in warm):
            r = warm[-1]
            raise ValueError(f"the warm-up request failed ({r.error}: {r.error_message[:200]}); "
                             "pass --warmup 0 to measure a failing server anyway")  # fmt: skip
        server = await _server_header(client, target)
        before = await serve_stages.scrape(client, target.headers) if args.stages else None
        if args.client_processes > 1:
            result = await asyncio.to_thread(
                run_processes, target, load, items, args.client_processes
            )
        else:
            enabled = sys.stderr.isatty() if args.progress is None else args.progress
            bar = Progress(len(items), enabled)
            cpu = time.process_time()
            result = await run_load(client, target, load, items, on_done=bar.update)
            busy = time.process_time() - cpu
            result.client_cpu_cores = [busy / result.duration if result.duration > 0 else 0.0]
        after = None if before is None else await serve_stages.scrape(client, target.headers)
        stages: dict[str, Any] = {}
        if before is not None and after is not None:
            stages = serve_stages.breakdown(before, after, result.duration)
        return target, result, server, stages


async def _server_header(client: httpx.AsyncClient, target: Target) -> str:
    """What the server calls itself (the `server` header of /health or /v1/models)."""
    for path in ("/health", "/v1/models"):
        try:
            r = await client.get(path, headers=target.headers, timeout=5)
        except httpx.HTTPError:
            continue
        if "server" in r.headers:
            return r.headers["server"]
    return ""


def run(args: argparse.Namespace) -> dict[str, Any]:
    _check(args)
    slos = parse_slos(args.goodput)
    if args.plot is not None:
        require_matplotlib()
    items, dataset = prompts(args)
    target, result, server, stages = asyncio.run(_bench(args, items))
    load = "all at once" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    out: dict[str, Any] = {
        "benchmark": "serve",
        "label": args.label,
        **summarize(result.results, result.duration, slos),
        "url": target.url,
        "endpoint": target.endpoint,
        "model": target.model,
        "server": server,
        "num_prompts": len(items),
        "concurrency": args.concurrency,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "dataset": dataset,
        "ignore_eos": args.ignore_eos,
        "httpx": httpx.__version__,
        "client_cpu_cores": [round(c, 3) for c in result.client_cpu_cores],
        "stages": stages,  # an lmd server's own breakdown (serve_stages.py); {} otherwise
    }
    if args.plot is not None:
        cap = f", concurrency {args.concurrency}" if args.concurrency else ""
        title = (f"{target.model} at {target.url}{target.endpoint}: {len(items)} prompts "
                 f"({dataset['name']}), {load}{cap}, {time.strftime('%Y-%m-%d')}")  # fmt: skip
        plot_serve(result, args.plot, title)
        out["plot"] = str(args.plot)
    return out


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.2f}{unit}"


def summary(result: dict[str, Any]) -> str:
    rate = result["request_rate"]
    load = "all at once" if rate is None else f"Poisson {rate:g} req/s"
    if result["concurrency"]:
        load += f", at most {result['concurrency']} in flight"
    lines = [
        f"{result['model']} at {result['url']}{result['endpoint']} ({result['server'] or '?'})",
        f"{result['num_prompts']} prompts ({result['dataset']['name']}), {load}",
        f"{'completed / failed':<26}{result['completed']} / {result['failed']}",
        f"{'duration':<26}{_fmt(result['duration_s'], ' s')}",
        f"{'input / output tokens':<26}{result['total_input_tokens']:,} / "
        f"{result['total_output_tokens']:,} ({result['total_cached_tokens']:,} input cached)",
        f"{'request throughput':<26}{_fmt(result['request_throughput'], ' req/s')}",
        f"{'output throughput':<26}{_fmt(result['output_throughput'], ' tok/s')}",
        f"{'total token throughput':<26}{_fmt(result['total_token_throughput'], ' tok/s')}",
    ]
    if "goodput" in result:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in result["slo_ms"].items())
        lines.append(f"{'goodput':<26}{_fmt(result['goodput'], ' req/s')} "
                     f"({result['good_requests']} requests with {slos})")  # fmt: skip
    lines.append(f"{'ms':<10}" + "".join(f"{h:>12}" for h in ("mean", "p50", "p90", "p99")))
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = result[key]
        name = key.removesuffix("_ms").upper()
        lines.append(f"{name:<10}" + "".join(f"{_fmt(row[q]):>12}" for q in row))
    for kind, count in result["failed_kinds"].items():
        lines.append(f"failed {kind}: {count} (e.g. {result['failed_examples'][kind][:120]})")
    lines += serve_stages.lines(result.get("stages") or {})
    cores = result.get("client_cpu_cores") or []
    busy = ", ".join(f"{c:.2f}" for c in cores)
    lines.append(f"{'client CPU cores busy':<26}{busy}")
    if any(c >= CLIENT_BUSY for c in cores):
        lines.append("the client was busy for most of the run: its figures may be its own; "
                     "rerun with more --client-processes")  # fmt: skip
    if result.get("plot"):
        lines.append(f"plot: {result['plot']}")
    return "\n".join(lines)
