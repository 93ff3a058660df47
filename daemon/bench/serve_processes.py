"""`lmd-bench serve --client-processes N`: the load driven from N client processes.

One asyncio process parsing server-sent events tops out near one core: measured on the
H100 machine, a server streaming 35-40k tokens/s kept the client busy enough that
tokens arrived in bursts (inter-token p50 0.01 ms, p99 over 100 ms), so the figures
measured the client. With N processes, process i takes prompts i, i+N, ... , its share
of the concurrency (and 1/N of a Poisson rate: the sum of Poisson arrivals is Poisson
again), and all start at one instant of the shared monotonic clock (perf_counter is
CLOCK_MONOTONIC on Linux, one clock for every process of the machine). Their results
merge into one run, in prompt order. Each process's CPU over its run is reported
(`client_cpu_cores`): near 1.0 means the client, not the server, set the pace.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

from lmd.bench.serve_client import Load, Run, Target, http_client, run_load
from lmd.bench.serve_data import Prompt
from lmd.bench.serve_metrics import RequestResult

START_DELAY_S = 2.0  # for the processes to start and import before the common start


def shares(load: Load, n: int, num_processes: int) -> list[tuple[list[int], Load]]:
    """Which prompts (indexes) and what load each process drives."""
    out = []
    for i in range(num_processes):
        indexes = list(range(i, n, num_processes))
        cap = load.concurrency
        concurrency = None if cap is None else cap // num_processes + (i < cap % num_processes)
        rate = load.request_rate
        share = Load(rate if math.isinf(rate) else rate / num_processes, concurrency, load.seed + i)
        if indexes and (concurrency is None or concurrency > 0):
            out.append((indexes, share))
    return out


def _drive(
    target: Target, load: Load, prompts: list[Prompt], start_at: float
) -> tuple[list[RequestResult], float, float, float]:
    """One client process: its results, start, end and CPU seconds over its run."""

    async def drive() -> tuple[Run, float]:
        async with http_client(target) as client:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
            cpu = time.process_time()  # the load's alone, not the start's
            run = await run_load(client, target, load, prompts)
            return run, time.process_time() - cpu

    run, cpu_s = asyncio.run(drive())
    return run.results, run.start, run.end, cpu_s


def run_processes(target: Target, load: Load, prompts: list[Prompt], num_processes: int) -> Run:
    """The whole load from `num_processes` processes as one run (with each one's cores
    busy)."""
    plan = shares(load, len(prompts), num_processes)
    start_at = time.perf_counter() + START_DELAY_S
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(plan), mp_context=context) as pool:
        futures = [
            pool.submit(_drive, target, share, [prompts[i] for i in indexes], start_at)
            for indexes, share in plan
        ]
        outcomes = [f.result() for f in futures]
    results: list[RequestResult | None] = [None] * len(prompts)
    cores = []
    for (indexes, _), (done, start, end, cpu_s) in zip(plan, outcomes, strict=True):
        for i, result in zip(indexes, done, strict=True):
            results[i] = result
        cores.append(cpu_s / (end - start) if end > start else 0.0)
    merged = [r for r in results if r is not None]
    return Run(merged, min(o[1] for o in outcomes), max(o[2] for o in outcomes), cores)
